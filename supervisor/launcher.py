"""One `primerl rl` run without `--dry-run`: the run directory, the roles as child processes, live progress, the end.

Order: the fast preflight checks (in ``cli/rl.py``) -> broker, and the slow preflight checks (environments,
tokenizer: ``LaunchOptions.preflight``) in a thread beside everything that follows -> broker ready (file) ->
inference (and the ``[teacher]``, a second ``primerl-infer``) and the trainer at once (it builds its model while
vLLM starts), and the orchestrator too unless it runs evals or scores with a teacher -> once inference (and the
teacher) are ready, the orchestrator if not started. The orchestrator waits for the preflight's verdict
(``runtime.start_gate``) before its first rollout; a finding stops every role and the run ends with the finding's
line and exit status 2, as if the preflight had run first. The run succeeds when the trainer exits 0; Ctrl-C and
SIGTERM stop every role, the broker last (the others deregister while it answers). Once every role has stopped,
``{run_dir}/run_end.json`` (``runtime.run_outcome``) says how the run ended, for `primerl status` and the dashboard.

Invariants: each role logs to ``{run_dir}/logs/<role>.log``, runs in a process group of its own and is ended by the
reaper if the launcher dies (``process_supervisor``, ``process_reaper``); the run token reaches the children in
``$PRIMERL_RUN_TOKEN`` only, never in a written config; ``{run_dir}/run.json`` (mode 0600, ``run_file``) holds the
broker's address and the token once the broker is ready; every role gets a CPU thread budget
(``primerl.runtime.cpu_budget``) in its config and its environment before any library loads. A role that fails
once the run is under way is restarted by ``restarts`` (``--restart``, ``--restart-limit``,
``--restart-window-s``); past the limit, with exit status 2 or with ``--restart never``, its failure stops the run
with its last error line and log tail.
"""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from primerl.proto.ready_file import READY_FILE_NAMES, ready_file_path
from primerl.proto.shared_segment import remove_stale_segments
from primerl.runtime.config_loader import write_toml
from primerl.runtime.cpu_budget import describe, role_env
from primerl.runtime.run_files import LOGS_DIR, RUN_CONFIG_FILE
from primerl.runtime.run_metrics import read_run_rows
from primerl.runtime.run_outcome import RunEndRecorder
from primerl.runtime.start_gate import ENV_CHECK_FILE_NAME, GATE_FILE_NAME, GATE_VAR
from primerl.supervisor.broker_links import dashboard_server, new_metrics_urls, run_file, status_client
from primerl.supervisor.console import RunConsole
from primerl.supervisor.preflight_gate import PreflightFailed, PreflightGate
from primerl.supervisor.process_supervisor import ChildFailed, ChildProcess, Supervisor
from primerl.supervisor.restart_policy import RestartPolicy
from primerl.supervisor.restarts import Restarts
from primerl.supervisor.role_configs import RoleFiles, has_gpus, thread_budgets, without_token
from primerl.supervisor.role_logs import last_error_in_log
from primerl.supervisor.run_file import RUN_FILE_NAME, write_run_file
from primerl.supervisor.run_progress import Progress, run_summary
from primerl.supervisor.tmux import close_tmux, open_tmux

RUN_TOKEN_ENV = "PRIMERL_RUN_TOKEN"
BIN = Path(sys.executable).parent
TAIL_LINES = 30
CHECK_INTERVAL_S = 0.2
"""How often the supervising loop looks at the children (the progress line refreshes every progress_interval_s)."""
BROKER_CLIENTS = ("trainer", "orchestrator", "inference", "teacher")
EARLY_STOP_TIMEOUT_S = 10.0
"""Before the run is under way, how long a role may take to stop (it stops at once; the bound covers a stop that
lands in a library call that holds the signal off) before it is killed; ``--stop-timeout-s`` applies afterwards."""


@dataclass
class LaunchOptions:
    broker_timeout_s: float = 60.0
    inference_timeout_s: float = 300.0
    stop_timeout_s: float = 30.0
    final_version_timeout_s: float = 30.0
    # Once the trainer finished, how long an orchestrator still at work (its eval at the last step) may finish
    # before it is stopped (the broker keeps inference for it as long: ``broker.service.ORCHESTRATOR_FINISH_S``).
    orchestrator_finish_timeout_s: float = 600.0
    tmux: bool = False
    progress_interval_s: float = 1.0
    plain_interval_s: float = 10.0  # a new progress line at most this often when stdout is not a terminal
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    reaper_grace_s: float = 2.0  # from SIGTERM to SIGKILL of what a killed `primerl rl` left
    dashboard: bool = True  # serve the run's web page (`primerl dashboard`) in this process once the broker is up
    dashboard_port: int = 0  # on 127.0.0.1; 0: a free port
    # The preflight's slow checks, run while the roles start (``cli.preflight.roles.BackgroundPreflight``): None
    # when they ran before the start (``--preflight-first``) or not at all (``--no-preflight``).
    preflight: object | None = None


def orchestrator_starts_early(config) -> bool:
    """Whether the orchestrator starts with inference and the trainer: it waits for inference workers by itself;
    not for a teacher (a group whose scoring finds none listed fails once its retries are spent, and the teacher
    may be ready seconds after inference), nor before an eval at step 0 (it then starts once they are ready)."""
    return config.orchestrator.eval is None and config.teacher is None


class Launcher:
    """One `primerl rl` run: ``run()`` returns the launcher's exit status."""

    def __init__(self, config, options: LaunchOptions, out: TextIO = sys.stdout, err: TextIO = sys.stderr):
        self.config = config
        self.options = options
        self.out, self.err = out, err
        self.run_dir = Path(config.output_dir)
        self.logs_dir = self.run_dir / LOGS_DIR
        # The config's token, else an exported one (a user who set it can reach the run with it), else a fresh one.
        self.token = config.broker.run_token or os.environ.get(RUN_TOKEN_ENV) or secrets.token_urlsafe(24)
        self.signal_count = 0
        self.signal_name = ""
        self.supervisor = Supervisor(interrupted=lambda: self.signal_count > 0, reaper_grace_s=options.reaper_grace_s)
        self.console = RunConsole(out)
        self.role_files = RoleFiles(self.run_dir)
        self.restarts = Restarts(self.supervisor, options.restart, self.role_files, self.run_dir, self.console)
        self.under_way = False  # every role started (and the ones with a ready file ready once)
        self.tmux_session: str | None = None
        self.progress = Progress(max_steps=config.trainer.max_steps or 0)
        self.is_tty = self.console.is_tty
        self.announced_metrics: set[str] = set()
        self.use_gpus = False  # set when the run starts
        self.budgets: dict = {}  # role -> its CPU thread budget, once the role configs are made
        self.dashboard = None  # the run's web page (primerl.dashboard.server.DashboardServer), once served
        self.preflight = PreflightGate(options.preflight, self.supervisor, self.run_dir / GATE_FILE_NAME)
        self.run_end = RunEndRecorder(self.run_dir, err)  # RUN_DIR/run_end.json: how the run ended

    # ----------------------------------------------------------------------------------------- helpers
    def say(self, text: str) -> None:
        self.console.say(text)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signal_count += 1
        self.signal_name = signal.Signals(signum).name
        if self.signal_count > 1:  # a second Ctrl-C: no more waiting
            self.supervisor.kill_all()

    def _env(self, gpu_ids: list[int] | None) -> dict[str, str]:
        env = {**os.environ, RUN_TOKEN_ENV: self.token, "PYTHONUNBUFFERED": "1"}
        if gpu_ids is not None and self.use_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
        return env

    def _child(self, role: str, argv: list[str], gpu_ids: list[int] | None = None) -> ChildProcess:
        env = {**self._env(gpu_ids), **role_env(role, self.budgets[role])}
        if role == "orchestrator" and self.options.preflight is not None:  # its first rollout waits for the verdict
            env[GATE_VAR] = str(self.preflight.gate_path.resolve())
            env.update(self.options.preflight.orchestrator_env())  # it checks the environments it loads
        child = self.supervisor.start(ChildProcess(role, argv, self.logs_dir / f"{role}.log", env))
        self.supervisor.write_pids(self.run_dir / "pids.json")
        return child

    def _open_tmux(self, roles: list[str]) -> None:
        self.tmux_session = open_tmux(self.run_dir, self.logs_dir, roles)
        self.say(f"  tmux session {self.tmux_session}: `tmux attach -t {self.tmux_session}` shows one pane per role")

    def _close_tmux(self) -> None:
        if self.tmux_session is not None:
            close_tmux(self.tmux_session)

    def _write_configs(self, roles: dict) -> dict[str, Path]:
        write_toml(without_token(self.config), self.run_dir / RUN_CONFIG_FILE)
        return {role: self.role_files.set(role, config) for role, config in roles.items()}

    # -------------------------------------------------------------------------------------------- run
    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        self.use_gpus = has_gpus()
        code = None  # None: an exception escaped
        try:
            code = self._run_to_end(time.monotonic())
            return code
        finally:
            self.preflight.end()
            self.supervisor.stop(timeout_s=self._stop_timeout_s(), on_kill=self._on_kill)
            self.run_end.write(code, self.progress.served_version)  # every role has stopped
            self.supervisor.close()
            remove_stale_segments()  # shared weight segments of a trainer that was killed
            self._close_tmux()
            if self.dashboard is not None:
                self.dashboard.close()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _run_to_end(self, started_s: float) -> int:
        try:
            return self._run(started_s)
        except PreflightFailed:
            return self._preflight_failed()
        except ChildFailed as failure:
            # e.g. an orchestrator that cannot load what the preflight refused
            if self.preflight.explains_failure(lambda: self.signal_count > 0):
                return self._preflight_failed()
            return self._fail(failure.child, str(failure))

    def _on_kill(self, child: ChildProcess) -> None:
        limit_s = self._stop_timeout_s()
        print(f"primerl rl: {child.name} did not stop within {limit_s:g} s; killing it", file=self.err, flush=True)

    def _run(self, started_s: float) -> int:
        # Unset broker ports: free ones (two runs on one machine never collide); the others learn them below.
        config = self.config = self.config.with_free_broker_ports()
        clashes = config.port_clashes()
        if clashes:
            print(
                "primerl rl: every role runs on this machine, so their ports must differ:\n  " + "\n  ".join(clashes),
                file=self.err,
                flush=True,
            )
            return 2
        roles = config.role_configs()
        paths = self._prepare_run_dir(roles)
        started = self._start_broker(roles, paths)
        if started is None:
            return self._interrupted()
        address, starting = started
        inference, teacher, orchestrator_argv, early_orchestrator, engines = starting
        # Meanwhile a failed trainer or orchestrator is restarted (or stops the run) as during training.
        for server in (inference, teacher):
            if server is not None and not self._wait_served(server, [teacher] if server is inference else []):
                return self._interrupted()
        if not early_orchestrator:
            self._child("orchestrator", orchestrator_argv, [])
            why = "it runs evals" if config.orchestrator.eval is not None else "it scores with the teacher"
            self.say(f"  orchestrator started (after {engines}: {why})")
        self.under_way = True
        self.say("  training ...")
        return self._supervise(address, started_s)

    def _prepare_run_dir(self, roles: dict) -> dict[str, Path]:
        """The run directory without a former run's ready, run and gate files; the role configs and thread budgets
        written; their paths by role."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        for stale in (*READY_FILE_NAMES.values(), RUN_FILE_NAME, GATE_FILE_NAME, ENV_CHECK_FILE_NAME):
            (self.run_dir / stale).unlink(missing_ok=True)
        self.run_end.clear()
        self.budgets = thread_budgets(self.config, roles, gpus=self.use_gpus)
        paths = self._write_configs(roles)
        self.say(f"primerl rl: run directory {self.run_dir} (configs, logs/, pids.json)")
        self.say(f"  {describe(self.budgets)}")
        if self.options.tmux:
            self._open_tmux(
                ["broker", "inference", *(["teacher"] if "teacher" in roles else []), "orchestrator", "trainer"]
            )
        return paths

    def _start_broker(self, roles: dict, paths: dict[str, Path]) -> tuple[str, tuple] | None:
        """Start the broker and the preflight; the other roles start at once when the broker's address is fixed in
        the config, else once it is ready (at the port it bound). The broker's address and the started roles
        (``_start_roles``); None when interrupted first."""
        config = self.config
        broker_ready = ready_file_path(self.run_dir, "broker")
        broker = self._child("broker", [BIN / "primerl-broker", "@", paths["broker"], "--ready-file", broker_ready])
        self.preflight.start()
        # A gRPC port fixed in the config: the others know the broker's address now and start at once (they wait
        # for it to answer by themselves, broker.connect_timeout_s); else they learn the port it bound.
        fixed = f"{config.broker.client_host}:{config.broker.grpc_port}" if config.broker.grpc_port else None
        if fixed is not None and any(r in roles and roles[r].broker.address != fixed for r in BROKER_CLIENTS):
            fixed = None  # a role dials another address (its own [role.broker] address): it waits as before
        starting = self._start_roles(config, roles, paths) if fixed is not None else None
        endpoints = self.supervisor.wait_ready_file(
            broker,
            broker_ready,
            self.options.broker_timeout_s,
            watch=[c for c in starting[:2] if c is not None] if starting is not None else [],
            tick=self._look_after_starting if starting is not None else self.preflight.check,
        )
        if endpoints is None:
            return None
        address = f"{config.broker.client_host}:{endpoints['grpc_port']}"
        self.say(f"  broker ready in {broker.ready_s:.1f} s at {address} (log {broker.log_path})")
        self.restarts.pin_broker(endpoints)
        self._write_run_file(address, endpoints.get("run_id"))
        self._serve_dashboard(address)
        if endpoints.get("metrics_url"):
            self.say(f"  broker metrics at {endpoints['metrics_url']}")
        if starting is None:
            for role in BROKER_CLIENTS:
                if role in roles and roles[role].broker.address != address:  # they dial the port the broker bound
                    roles[role] = roles[role].model_copy(
                        update={"broker": roles[role].broker.model_copy(update={"address": address})}
                    )
                    self.role_files.set(role, roles[role])
            starting = self._start_roles(config, roles, paths)
        return address, starting

    def _wait_served(self, server: ChildProcess, watch: list) -> bool:
        """Wait for an inference server (or the teacher) to write its ready file; False when interrupted."""
        served = self.supervisor.wait_ready_file(
            server,
            ready_file_path(self.run_dir, server.name),
            self.options.inference_timeout_s,
            watch=[child for child in watch if child is not None],
            tick=self._look_after_starting,
        )
        if served is None:
            return False
        self.say(f"  {server.name} ready in {server.ready_s:.1f} s at {served.get('base_url')}")
        self.restarts.pin_inference(served, server.name)
        return True

    def _start_roles(self, config, roles: dict, paths: dict[str, Path]) -> tuple:
        """Start inference (and the teacher), the trainer and, unless it must wait for them, the orchestrator."""

        def serve(name: str, gpu_ids: list[int]) -> ChildProcess:
            ready = ready_file_path(self.run_dir, name)
            return self._child(name, [BIN / "primerl-infer", "@", paths[name], "--ready-file", ready], gpu_ids)

        inference = serve("inference", config.inference_gpu_ids)
        teacher = serve("teacher", config.teacher_gpu_ids) if "teacher" in roles else None
        # The trainer only needs the broker: it loads its model while vLLM starts.
        num_ranks = len(config.trainer_gpu_ids)
        trainer_argv = [BIN / "primerl-trainer", "@", paths["trainer"]]
        if num_ranks > 1:
            trainer_argv = [BIN / "torchrun", "--standalone", f"--nproc-per-node={num_ranks}", *trainer_argv]
        self._child("trainer", trainer_argv, config.trainer_gpu_ids)
        ranks = f" ({num_ranks} ranks under torchrun)" if num_ranks > 1 else ""
        orchestrator_argv = [BIN / "primerl-orchestrator", "@", paths["orchestrator"]]
        early_orchestrator = orchestrator_starts_early(config)
        if early_orchestrator:
            self._child("orchestrator", orchestrator_argv, [])
        started = "trainer" + ranks + (" and orchestrator" if early_orchestrator else "")
        engines = "inference and the teacher" if teacher is not None else "inference"
        self.say(
            f"  starting {engines} (vLLM takes a while; log {inference.log_path}); {started} started meanwhile ..."
        )
        return inference, teacher, orchestrator_argv, early_orchestrator, engines

    def _supervise(self, address: str, started_s: float) -> int:
        from primerl.client.broker_errors import BrokerError

        client = status_client(address, self.token, self.config.trainer.broker)
        last_line_s = 0.0
        last_step = -1
        last_status_s = 0.0
        try:
            while True:
                if self.signal_count:
                    return self._interrupted()
                self.preflight.check()
                if self.restarts.look_after_children():
                    return self._finish(client, started_s)
                now = time.monotonic()
                if now - last_status_s < self.options.progress_interval_s:
                    time.sleep(CHECK_INTERVAL_S)
                    continue
                last_status_s = now
                try:
                    status = self.run_end.saw(client.get_run_status())
                    self.progress.update(status)
                    self._announce_metrics(status)
                except BrokerError:
                    pass  # the broker's own exit is caught above; a slow answer only delays the display
                now = time.monotonic()
                if self.is_tty:
                    self.console.show_progress(self.progress)  # redrawn in place, with rich
                elif self.progress.step != last_step or now - last_line_s >= self.options.plain_interval_s:
                    self.console.show_progress(self.progress)
                    last_line_s, last_step = now, self.progress.step
        finally:
            client.close()

    # ------------------------------------------------------------------------------------------ preflight
    def _look_after_starting(self) -> None:
        self.preflight.check()
        self.restarts.look_after_starting()

    def _preflight_failed(self) -> int:
        """Stop every role (none has generated a rollout: the orchestrator waits at the gate), then print the
        preflight's lines as when it runs first; exit status 2."""
        if self.is_tty:
            self.out.write("\n")
            self.out.flush()
        order = ("broker", "inference", "teacher", "trainer", "orchestrator")
        started = [name for name in order if name in self.supervisor.children]
        self._stop_all(list(self.supervisor.children))
        self.run_end.failed_because("the preflight found a problem (its line above; logs/preflight*.log)")
        return self.preflight.verdict(started)

    def _write_run_file(self, address: str, run_id: str | None) -> None:
        """``RUN_DIR/run.json`` (owner-only): the broker's address and the token, for ``primerl status RUN_DIR``."""
        write_run_file(self.run_dir, run_file(address, self.token, run_id, self.config.trainer.broker))
        self.say(
            f"  status: primerl status {shlex.quote(str(self.run_dir))}   (address and token in its "
            f"{RUN_FILE_NAME}, readable by you only)"
        )

    def _serve_dashboard(self, address: str) -> None:
        """The run's web page in a thread of this process (loopback, a fresh login token in its URL), reading the
        run directory and the broker with the trainer's credentials. A page that cannot be served is a note."""
        if not self.options.dashboard:
            return
        broker = self.config.trainer.broker
        try:
            self.dashboard = dashboard_server(self.run_dir, address, self.token, broker, self.options.dashboard_port)
        except (OSError, ValueError) as err:
            self.say(f"  dashboard not served: {err} (--dashboard-port, or --no-dashboard)")
            return
        self.dashboard.serve_in_thread()
        self.say(f"  dashboard: {self.dashboard.url}")

    def _announce_metrics(self, status) -> None:
        """Print each worker's metrics URL (the `metrics_url` it registered with) the first time it shows up."""
        for line in new_metrics_urls(status, self.announced_metrics):
            self.say(line)

    # ------------------------------------------------------------------------------------------ ends
    def _finish(self, client, started_s: float) -> int:
        """The trainer finished: wait (bounded) for inference to serve the last policy, then stop the rest."""
        from primerl.client.broker_errors import BrokerError

        deadline = time.monotonic() + self.options.final_version_timeout_s
        while time.monotonic() < deadline and not self.signal_count:
            try:
                self.progress.update(self.run_end.saw(client.get_run_status()))
            except BrokerError:
                break
            served = self.progress.served_version
            if served is not None and served >= self.progress.published_version:
                break
            time.sleep(0.2)
        if self.is_tty:
            self.out.write("\n")
        self._wait_for_orchestrator()
        stop_timeout_s = self.options.stop_timeout_s
        self.supervisor.stop(["orchestrator", "inference", "teacher"], timeout_s=stop_timeout_s, on_kill=self._on_kill)
        self.supervisor.stop(["broker"], timeout_s=stop_timeout_s, on_kill=self._on_kill)  # last: the others deregister
        for name, child in self.supervisor.children.items():  # the trainer exited 0 before
            code = child.poll()
            if name != "trainer" and code not in (0, None, -signal.SIGTERM):
                print(
                    f"primerl rl: note: {name} exited with status {code} while stopping; see {child.log_path}",
                    file=self.err,
                )
        rows = read_run_rows(Path(self.config.orchestrator.output_dir), Path(self.config.trainer.output_dir))
        wall_s = time.monotonic() - started_s
        summary = run_summary(rows, self.progress, self.supervisor.children.values(), wall_s, self.run_dir)
        self.console.show_summary(summary)
        return 0

    def _wait_for_orchestrator(self) -> None:
        """Let an orchestrator that is still at work once the trainer finished end by itself (bounded): it runs
        its eval at the last step after sending that step, and stopping it, or inference under it, cut the eval."""
        child = self.supervisor.children.get("orchestrator")
        if child is None or child.poll() is not None:
            return
        eval_config = self.config.orchestrator.eval
        max_steps = self.config.orchestrator.max_steps
        if eval_config is not None and max_steps is not None and max_steps % eval_config.interval == 0:
            self.say("  the trainer finished; waiting for the orchestrator's eval at the last step")
        deadline = time.monotonic() + self.options.orchestrator_finish_timeout_s
        while child.poll() is None and time.monotonic() < deadline and not self.signal_count:
            time.sleep(CHECK_INTERVAL_S)

    def _stop_timeout_s(self) -> float:
        """How long a role may take to stop: ``stop_timeout_s`` once the run is under way (a step's publish,
        checkpoint and commit may be in hand); before that a role has nothing to finish and stops at once
        (``primerl.cli.role_signals``), so a few seconds bound it."""
        if self.under_way:
            return self.options.stop_timeout_s
        return min(self.options.stop_timeout_s, EARLY_STOP_TIMEOUT_S)

    def _stop_all(self, first: list[str]) -> None:
        """Stop ``first`` together, then the broker (the others deregister while it still answers), then the
        rest."""
        timeout_s = self._stop_timeout_s()
        first = [name for name in first if name != "broker"]
        self.supervisor.stop(first, timeout_s=timeout_s, on_kill=self._on_kill)
        self.supervisor.stop(["broker"], timeout_s=timeout_s, on_kill=self._on_kill)
        self.supervisor.stop(timeout_s=timeout_s, on_kill=self._on_kill)

    def _fail(self, child: ChildProcess, message: str) -> int:
        if self.is_tty:
            self.out.write("\n")
            self.out.flush()
        self._stop_all([name for name in self.supervisor.children if name != child.name])
        code = child.poll()
        error = last_error_in_log(child.log_path) if code is None or code > 0 else None
        error_line = f"primerl rl: {child.name}'s last error: {error}\n" if error else ""
        self.run_end.failed_because(message + (f"; {child.name}'s last error: {error}" if error else ""))
        print(
            f"primerl rl: {message}; stopped the run.\n"
            f"--- last {TAIL_LINES} lines of {child.log_path} ---\n{child.log_tail(TAIL_LINES)}\n"
            f"--- end of {child.name} log ---\n{error_line}",
            file=self.err,
            flush=True,
        )
        return 1

    def _interrupted(self) -> int:
        if self.is_tty:
            self.out.write("\n")
        print(
            f"primerl rl: {self.signal_name}: stopping every role (at most {self._stop_timeout_s():g} s; "
            "again to kill at once)",
            file=self.err,
            flush=True,
        )
        # The broker last: the others finish their step's RPCs, publish and deregister while it still answers.
        self._stop_all(list(self.supervisor.children))
        print(f"primerl rl: stopped; logs in {self.logs_dir}", file=self.err, flush=True)
        return 128 + (signal.SIGINT if self.signal_name == "SIGINT" else signal.SIGTERM)
