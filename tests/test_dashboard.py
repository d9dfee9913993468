"""The dashboard's logic and API without a browser: login token and refusals, read-only methods, headers, the JSON
API over a run directory and over a live in-process broker (its bounded run history survives a restart), a run that
ended (its end shown from the run directory, its gone broker never asked) and one still running whose broker does not
answer, the orchestrator's sample-rollout records."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support import run_dirs
from support.probes import free_port
from support.run_dirs import MAX_STEPS, RUN_ID, write_ended_run

from primerl.broker.run_history import MAX_ROLLOUTS_PER_REPORT, RunHistory, RunHistoryFile
from primerl.dashboard.server import CSP, Dashboard, DashboardServer
from primerl.dashboard.sources import JsonlTail, RunDirSource, connect_broker
from primerl.orchestrator.rollout_samples import RolloutSamples, pick, to_record
from primerl.orchestrator.samples import TrainingSample
from primerl.runtime.run_files import ROLLOUTS_FILE

XSS = '<script>alert("x")</script><img src=x onerror=alert(1)>'


def write_run_dir(run_dir: Path, steps: int = 3) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "rl.toml").write_text("max_steps = 5\n\n[trainer]\nmax_steps = 5\n")
    with (run_dir / "metrics.jsonl").open("w") as out:
        for step in range(1, steps + 1):
            out.write(
                json.dumps({"step": step, "role": "orchestrator", "time": 100.0 + step, "train/reward": step / 10})
            )
            out.write("\n")
            out.write(json.dumps({"step": step, "role": "trainer", "time": 100.5 + step, "train/loss": 1.0 / step}))
            out.write("\n")
    record = {"step": 1, "env_id": "e", "example_id": 0, "rollout_id": 0, "reward": 1.0, "advantage": 0.5,
              "policy_version": 0, "truncated": False, "prompt": "p", "tokens": [[XSS, -0.1, True]],
              "tokens_dropped": 0, "time": 1.0}  # fmt: skip
    (run_dir / ROLLOUTS_FILE).write_text(json.dumps(record) + "\n")
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "trainer.log").write_text(
        "2026-11-27T19:52:29.826823Z [info     ] fine [x]\n2026-11-27T19:52:30.1Z [warning  ] disk is slow [x] a=1\n"
    )
    return run_dir


@pytest.fixture
def served(tmp_path):
    server = DashboardServer(Dashboard(RunDirSource(write_run_dir(tmp_path / "run"))), token="secret-token")
    server.serve_in_thread()
    yield server
    server.close()


def request(server, path: str, method: str = "GET", headers: dict | None = None, follow: bool = True):
    url = f"http://127.0.0.1:{server.port}{path}"
    req = urllib.request.Request(url, method=method, headers=headers or {})
    opener = urllib.request.build_opener() if follow else urllib.request.build_opener(_NoRedirect())
    try:
        with opener.open(req, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


AUTH = {"Authorization": "Bearer secret-token"}


@pytest.mark.parametrize("path", ["/", "/app.js", "/api/run", "/api/metrics", "/api/rollouts", "/nope"])
def test_every_route_refuses_without_the_token_and_with_a_wrong_one(served, path):
    code, _, body = request(served, path)
    assert code == 401 and b"no login token" in body
    code, _, body = request(served, path, headers={"Authorization": "Bearer secret-tokeN"})
    assert code == 403 and b"wrong login token" in body
    code, _, _ = request(served, path, headers={"Cookie": f"primerl_dashboard_{served.port}=nope"})
    assert code == 403
    code, _, _ = request(served, path + ("&" if "?" in path else "?") + "token=nope", follow=False)
    assert code == 403


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
def test_write_methods_are_refused_even_with_the_token(served, method):
    code, headers, body = request(served, "/api/run", method=method, headers=AUTH)
    assert code == 405 and headers["Allow"] == "GET, HEAD" and b"read-only" in body


def test_the_url_token_becomes_a_cookie_and_leaves_the_address(served):
    assert served.url == f"http://127.0.0.1:{served.port}/?token=secret-token"
    code, headers, _ = request(served, "/?token=secret-token", follow=False)
    assert code == 303 and headers["Location"] == "/"
    cookie = headers["Set-Cookie"]
    assert cookie.startswith(f"primerl_dashboard_{served.port}=secret-token;")
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    code, headers, body = request(served, "/", headers={"Cookie": f"primerl_dashboard_{served.port}=secret-token"})
    assert code == 200 and b'<script src="/app.js"' in body
    assert headers["Content-Security-Policy"] == CSP and "default-src 'self'" in CSP and "unsafe-inline" not in CSP
    assert headers["X-Content-Type-Options"] == "nosniff" and headers["Cache-Control"] == "no-store"


def test_the_page_has_no_inline_script_and_sets_run_data_as_text_only():
    static = Path(__file__).resolve().parents[1] / "dashboard" / "static"
    html = (static / "index.html").read_text()
    assert "<script>" not in html and " on" not in html.replace("<option", "")  # no inline script, no on* handler
    script = (static / "app.js").read_text()
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script and "eval(" not in script
    assert "http://" not in script.replace("http://www.w3.org/2000/svg", "") and "https://" not in script


def test_the_api_reads_a_finished_run_from_its_directory(served):
    def api(path):
        code, headers, body = request(served, path, headers=AUTH)
        assert code == 200 and headers["Content-Type"] == "application/json", body
        return json.loads(body)

    run = api("/api/run")
    assert run["state"] == "stopped" and run["step"] == 3 and run["max_steps"] == 5 and not run["broker"]
    metrics = api("/api/metrics")
    assert metrics["next"] == 6 and [r["step"] for r in metrics["rows"] if r["role"] == "trainer"] == [1, 2, 3]
    assert api("/api/metrics?since=4")["rows"] == metrics["rows"][4:]
    rollouts = api("/api/rollouts")["rollouts"]
    assert rollouts[0]["tokens"][0][0] == XSS  # as it was written: the page escapes it (textContent)
    assert api("/api/config")["text"].startswith("max_steps = 5")
    events = api("/api/events")["events"]
    assert [(e["source"], e["level"], e["message"]) for e in events] == [("trainer", "warning", "disk is slow [x] a=1")]
    assert api("/api/workers")["workers"] == []
    with (served.dashboard.run_dir.run_dir / "metrics.jsonl").open("a") as out:  # the run goes on: only new rows
        out.write(json.dumps({"step": 4, "role": "trainer", "time": 105.0, "train/loss": 0.2}) + "\n")
    assert [r["step"] for r in api("/api/metrics?since=6")["rows"]] == [4]
    assert api("/api/run")["step"] == 4


# ------------------------------------------------------------------------------------------ a run that ended
def serve_run_dir(run_dir: Path) -> DashboardServer:
    """`primerl dashboard RUN_DIR` in process: the run directory and the broker its run.json names."""
    from primerl.supervisor.run_file import read_run_file

    run = read_run_file(run_dir)
    server = DashboardServer(
        Dashboard(RunDirSource(run_dir), connect_broker(run.broker_address, run.run_token)), token="secret-token"
    )
    server.serve_in_thread()
    return server


def get_api(server: DashboardServer, path: str) -> dict:
    code, _, body = request(server, path, headers=AUTH)
    assert code == 200, body
    return json.loads(body)


def test_a_finished_run_shows_its_end_workers_and_queues_and_no_broker_error(tmp_path):
    run_dir = write_ended_run(tmp_path / "run", 0)  # its run.json names a broker that is gone
    server = serve_run_dir(run_dir)
    try:
        run = get_api(server, "/api/run")
        assert run["state"] == "finished" and run["broker_error"] == "" and run["run_id"] == RUN_ID, run
        assert run["step"] == run["max_steps"] == MAX_STEPS and run["latest_policy_version"] == MAX_STEPS
        assert run["end"]["state"] == "finished" and run["end"]["reason"] == f"the trainer finished step {MAX_STEPS}"
        assert run["end"]["ended_unix_ms"] > 0 and run["end"]["served_policy_version"] == MAX_STEPS
        workers = get_api(server, "/api/workers")
        assert workers["broker_error"] == "" and workers["as_of_unix_ms"] == 61_000
        assert [(w["name"], w["role"], w["policy_version"]) for w in workers["workers"]] == [
            ("trainer-rank0", "trainer", None),
            ("infer-0", "inference", MAX_STEPS),
        ]
        queues = get_api(server, "/api/queues")
        assert queues["broker_error"] == "" and queues["latest_policy_version"] == MAX_STEPS
        assert [(q["name"], q["num_items"]) for q in queues["queues"]] == [("rollouts", 2)]
        assert queues["rollout_batches_per_s"] == 0
        assert get_api(server, "/api/events")["recent_errors"] == []
        assert get_api(server, "/api/metrics")["source"] == "run_dir"
        assert server.dashboard.broker._read_s == 0.0  # the gone broker was never asked
    finally:
        server.close()


@pytest.mark.parametrize(("exit_code", "state"), [(130, "stopped"), (1, "failed")])
def test_a_stopped_or_failed_run_says_so(tmp_path, exit_code, state):
    failure = "trainer exited with status 1; stopped the run" if exit_code == 1 else ""
    server = serve_run_dir(write_ended_run(tmp_path / "run", exit_code, failure=failure, step=7))
    try:
        run = get_api(server, "/api/run")
        assert run["state"] == state and run["step"] == 7 and run["broker_error"] == "", run
        assert run["end"]["reason"] == (failure or "SIGINT: every role was stopped")
    finally:
        server.close()


def test_a_killed_launcher_s_run_shows_what_its_broker_spool_kept(tmp_path):
    run_dir = run_dirs.write_run_dir(tmp_path / "run", launcher_pid=run_dirs.dead_pid())
    run_dirs.write_spool(run_dir, finished=False, step=12)
    dashboard = Dashboard(RunDirSource(run_dir))
    run = dashboard.api("/api/run", {})
    assert run["state"] == "stopped" and run["latest_policy_version"] == 12 and "killed?" in run["end"]["reason"]
    workers = dashboard.api("/api/workers", {})["workers"]
    assert [(w["name"], w["state"]) for w in workers] == [("trainer-rank0", "left"), ("infer-0", "lost")]


def test_a_running_run_keeps_the_broker_error_banner(tmp_path):
    import os

    address = f"127.0.0.1:{free_port()}"
    server = serve_run_dir(run_dirs.write_run_dir(tmp_path / "run", launcher_pid=os.getpid(), broker_address=address))
    try:
        run = get_api(server, "/api/run")
        assert run["end"] is None and run["state"] == "unreachable" and address in run["broker_error"], run
        assert get_api(server, "/api/workers")["as_of_unix_ms"] is None
    finally:
        server.close()


# --------------------------------------------------------------------------------------------- broker
def orchestrator_client(broker):
    from primerl.client.control import ControlClient
    from primerl.runtime.config_common import BrokerClientConfig

    client = ControlClient(BrokerClientConfig(address=broker.grpc_address), "orchestrator", "orchestrator")
    client.register()
    return client


def test_the_broker_keeps_a_bounded_history_that_a_restarted_broker_still_serves(make_broker):
    broker = make_broker(history_max_bytes=200_000)
    client = orchestrator_client(broker)
    record = json.dumps({"step": 1, "env_id": "e", "tokens": [[XSS, -0.5, True]], "prompt": "x" * 3000})
    for step in range(1, 41):
        client.report_metrics(step, {"train/reward": step / 100, "pad/x": 1.0})
        client.report_rollouts(step, [record.replace('"step": 1', f'"step": {step}')])
    history = client.get_run_history()
    assert history.max_bytes == 200_000 and 0 < history.num_bytes <= 200_000
    assert [row.step for row in history.rows] == list(range(1, 41)) and history.metrics_next == 40
    rollout_steps = [json.loads(r)["step"] for r in history.rollouts]
    assert rollout_steps == list(range(41 - len(rollout_steps), 41)) and len(rollout_steps) < 40  # oldest dropped
    assert history.rollouts_next == 40
    assert [e.kind for e in history.events][:1] == ["joined"]
    later = client.get_run_history(metrics_since=38, events_since=history.events_next, rollouts_since=39)
    assert [row.step for row in later.rows] == [39, 40] and len(later.rollouts) == 1 and not later.events
    with pytest.raises(Exception, match="not a JSON object"):
        client.report_rollouts(41, ["[1, 2]"])
    with pytest.raises(Exception, match="at most"):
        client.report_rollouts(41, ["{}"] * (MAX_ROLLOUTS_PER_REPORT + 1))
    client.close()
    broker.restart()  # the history was written to the spool by the stop
    reader = orchestrator_client(broker)
    again = reader.get_run_history()
    assert [row.step for row in again.rows] == list(range(1, 41)) and again.rollouts == history.rollouts
    assert again.metrics_next == 40 and again.events_next >= history.events_next
    reader.close()


def test_the_dashboard_reads_a_live_broker_alone(make_broker):
    broker = make_broker()
    client = orchestrator_client(broker)
    client.report_metrics(1, {"train/reward": 0.5})
    client.report_rollouts(1, [json.dumps({"step": 1, "env_id": "e", "tokens": [[XSS, -1.0, True]]})])
    dashboard = Dashboard(None, connect_broker(broker.grpc_address, None))
    try:
        run = dashboard.api("/api/run", {})
        assert run["broker"] and run["state"] == "starting" and run["run_id"] == broker.service.run_id
        workers = dashboard.api("/api/workers", {})["workers"]
        assert [(w["name"], w["role"], w["state"]) for w in workers] == [("orchestrator", "orchestrator", "alive")]
        metrics = dashboard.api("/api/metrics", {})
        assert metrics["source"] == "broker" and metrics["rows"][0]["train/reward"] == 0.5
        assert metrics["rows"][0]["role"] == "orchestrator"
        assert dashboard.api("/api/rollouts", {})["rollouts"][0]["tokens"][0][0] == XSS
        assert any(e["kind"] == "joined" for e in dashboard.api("/api/events", {})["events"])
        queues = dashboard.api("/api/queues", {})
        assert queues["history_max_bytes"] == broker.config.history_max_bytes and queues["history_bytes"] > 0
        with urllib.request.urlopen(broker.endpoints.metrics_url, timeout=10) as response:  # shown in its metrics
            scraped = response.read().decode()
        gauge = [line for line in scraped.splitlines() if line.startswith("primerl_broker_history_bytes ")]
        assert gauge and float(gauge[0].split()[1]) == broker.service.history.num_bytes > 0
    finally:
        dashboard.close()
        client.close()


def test_a_history_file_that_cannot_be_read_is_set_aside(tmp_path):
    (tmp_path / "run_history.json").write_text('{"format": "primerl.run_history/1", "rows": 3}')
    history = RunHistory(1000)
    assert not RunHistoryFile(tmp_path).load_into(history)
    assert (tmp_path / "run_history.json.corrupt").exists() and history.since().rows == []


# ------------------------------------------------------------------------------------------- samples
def sample(reward: float, rollout_id: int, env_id: str = "e", completion: int = 3) -> TrainingSample:
    n = 2 + completion
    return TrainingSample(
        token_ids=list(range(10, 10 + n)),
        loss_mask=[False, False] + [True] * completion,
        inference_logprobs=[0.0, 0.0] + [-0.5] * completion,
        temperatures=[1.0] * n,
        policy_versions=[0, 0] + [3] * completion,
        reward=reward,
        advantage=reward - 0.5,
        env_id=env_id,
        rollout_id=rollout_id,
    )


def test_samples_are_the_best_and_worst_rollouts_of_each_env_and_stay_bounded(tmp_path):
    samples = [sample(r / 10, i) for i, r in enumerate([3, 9, 1, 5])] + [sample(0.2, 0, env_id="f")]
    assert [(s.env_id, s.reward) for s in pick(samples, 2)] == [("e", 0.9), ("e", 0.1), ("f", 0.2)]
    record = to_record(7, sample(1.0, 0, completion=3000), lambda ids: [f"<{i}>" for i in ids], 4096)
    assert len(json.dumps(record).encode()) <= 4096 and record["tokens_dropped"] > 0
    assert (
        record["prompt"] == "<10><11>" and record["policy_version"] == 3 and record["tokens"][0] == ["<12>", -0.5, True]
    )
    sent = []
    writer = RolloutSamples(
        tmp_path,
        "no-such-model",
        decoder=lambda ids: [str(i) for i in ids],
        on_records=lambda s, r: sent.append((s, r)),
    )
    writer.add(1, samples)
    writer.close()
    lines = [json.loads(line) for line in (tmp_path / ROLLOUTS_FILE).read_text().splitlines()]
    assert len(lines) == 3 and {line["step"] for line in lines} == {1} and sent[0][1] == lines


# ------------------------------------------------------------------------------------ the command
def test_the_command_reads_a_broker_on_its_address_with_mutual_tls_and_the_run_token(make_broker, tmp_path):
    import re
    import subprocess
    import sys
    import time

    from primerl.cli.certs import make_certs

    certs = make_certs(tmp_path / "certs", ["127.0.0.1"], ("orchestrator", "status"))
    broker = make_broker(run_token="run-secret", **certs.broker_settings())
    tls = certs.client_settings("status")
    bin_dir = Path(sys.executable).parent

    def serve(token: str) -> tuple[subprocess.Popen, str]:
        argv = [str(bin_dir / "primerl"), "dashboard", "--broker", broker.grpc_address, "--token", token]
        argv += ["--tls-ca", tls["tls_ca_path"], "--tls-cert", tls["tls_cert_path"], "--tls-key", tls["tls_key_path"]]
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = process.stdout.readline()
        match = re.search(r"at (http://127\.0\.0\.1:(\d+)/\?token=(\S+))", line)
        assert match, line + process.stdout.read() if process.poll() is not None else line
        return process, match[1]

    def get(url: str, path: str) -> dict:
        base, token = url.split("/?token=")
        req = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=20) as response:
            return json.loads(response.read())

    process, url = serve("run-secret")
    try:
        run = get(url, "/api/run")
        assert run["broker"] and run["broker_error"] == "" and run["run_id"] == broker.service.run_id, run
        from primerl.client.control import ControlClient
        from primerl.runtime.config_common import BrokerClientConfig

        worker_tls = {k: v for k, v in certs.client_settings("orchestrator").items() if k.startswith("tls_")}
        config = BrokerClientConfig(address=broker.grpc_address, run_token="run-secret", **worker_tls)
        with ControlClient(config, "orchestrator", "orchestrator") as worker:
            worker.register()
            worker.report_metrics(1, {"train/reward": 0.25})
            time.sleep(1.0)  # past the dashboard's cache of the broker's answers
            assert [w["name"] for w in get(url, "/api/workers")["workers"]] == ["orchestrator"]
            assert get(url, "/api/metrics")["rows"][0]["train/reward"] == 0.25
    finally:
        process.terminate()
        process.wait(20)
    process, url = serve("wrong-secret")
    try:
        run = get(url, "/api/run")
        assert run["state"] == "unreachable" and "wrong run token" in run["broker_error"], run
    finally:
        process.terminate()
        process.wait(20)


def test_the_command_says_what_it_needs():
    from primerl.cli.dashboard import main

    assert main([]) == 2
    assert main(["/no/such/run/dir"]) == 2
    assert main(["--broker", "127.0.0.1:1", "--port", "70000"]) == 2


def test_a_history_reply_stays_under_its_bound_and_says_where_to_go_on():
    history = RunHistory(10 << 20)
    for step in range(1, 101):
        history.add_metrics(2, step, {f"m{i}": float(i) for i in range(50)})
    first = history.since(max_reply_bytes=40_000)
    assert first.truncated and 0 < len(first.rows) < 100 and first.metrics_next == len(first.rows)
    assert len(json.dumps(first.rows)) <= 40_000 * 0.5 + 2_000
    steps, index, reply = [r["step"] for r in first.rows], first.metrics_next, first
    while reply.truncated:
        reply = history.since(index, reply.events_next, reply.rollouts_next, max_reply_bytes=40_000)
        steps += [r["step"] for r in reply.rows]
        index = reply.metrics_next
    assert steps == list(range(1, 101)) and index == 100


def test_a_rewritten_file_is_read_again_from_its_start(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"n": i}) + "\n" for i in range(5)))
    tail = JsonlTail(path, 100, json.loads)
    items, next_index = tail.since(0)
    assert [item["n"] for item in items] == [0, 1, 2, 3, 4] and next_index == 5
    replacement = tmp_path / "new.jsonl"  # a new run in the same directory: another file, fewer lines
    replacement.write_text(json.dumps({"n": 100}) + "\n")
    replacement.replace(path)
    items, next_index = tail.since(5)
    assert next_index == 1 < 5  # the reader sees the index went back, and reads again from 0
    assert [item["n"] for item in tail.since(0)[0]] == [100]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_stops_the_command_while_a_page_holds_its_connection_open(tmp_path, signum, inherited):
    """A browser keeps its HTTP/1.1 connection open between polls; Ctrl-C (or SIGTERM) must not wait for it to let
    go, also where the command inherited SIGINT ignored (started in the background of a script: CI's case, where
    the stop never came)."""
    import http.client
    import re
    import subprocess
    import sys

    run_dir = write_run_dir(tmp_path / "run")
    argv = [str(Path(sys.executable).parent / "primerl"), "dashboard", str(run_dir), "--no-broker"]
    ignore = signal.SIG_IGN if inherited == "ignored" else signal.SIG_DFL
    process = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, ignore),  # as a background job inherits it
    )
    connection = None
    try:
        # The first lines may be gRPC's, written by this test process's fork handlers in the child before its exec
        # (preexec_fn forks; gRPC is loaded here by earlier tests): "epoll_wait error: Bad file descriptor".
        seen, match = "", None
        for _ in range(20):
            line = process.stdout.readline()
            seen += line
            match = re.search(r"at http://127\.0\.0\.1:(\d+)/\?token=(\S+)", line)
            if match or not line:
                break
        assert match, seen + (process.stdout.read() if process.poll() is not None else "")
        connection = http.client.HTTPConnection("127.0.0.1", int(match[1]), timeout=20)
        connection.request("GET", "/api/run", headers={"Authorization": f"Bearer {match[2]}"})
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("Connection") != "close"
        response.read()  # the connection stays open, as a polling page's does
        process.send_signal(signum)
        assert process.wait(20) == 0
    finally:
        if connection is not None:
            connection.close()
        if process.poll() is None:
            process.kill()
            process.wait(10)
