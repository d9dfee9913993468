"""The restarts of `primerl rl`'s roles: the ports a role bound at its first start pinned in its config, so that a
restart with the same command comes back where the others look for it, and the look after the children that
restarts a dead role (``primerl.supervisor.restart_policy``) or stops the run (``ChildFailed``).

`Restarts` owns the restart bookkeeping (budgets, due restarts, the exits dealt with, roles that finished early,
roles not yet back); the launcher asks it to pin and to look after the children, and learns from the answer
whether the trainer finished.
"""

from __future__ import annotations

import time
from pathlib import Path

from primerl.proto.ready_file import READY_FILE_NAMES
from primerl.supervisor.console import RunConsole
from primerl.supervisor.process_supervisor import ChildFailed, ChildProcess, Supervisor
from primerl.supervisor.restart_policy import RestartBudget, RestartPolicy, describe_exit_code
from primerl.supervisor.role_configs import RoleFiles, pinned_broker, pinned_inference
from primerl.supervisor.role_logs import last_error_in_log

FINISH_WAIT_S = 60.0
"""How long an inference worker (or teacher) that exited 0 (the broker said the run is over) may precede the
trainer's exit."""


class Restarts:
    """Pinning and restarts of a run's roles (see the module docstring)."""

    def __init__(
        self, supervisor: Supervisor, policy: RestartPolicy, role_files: RoleFiles, run_dir: Path, console: RunConsole
    ) -> None:
        self.supervisor = supervisor
        self.policy = policy
        self.role_files = role_files
        self.run_dir = run_dir
        self.console = console
        self.budgets: dict[str, RestartBudget] = {}
        self.pending: dict[str, float] = {}  # role -> monotonic s at which it starts again
        self.handled_exits: dict[str, int] = {}  # role -> the start (num_starts) whose exit was dealt with
        self.clean_exit_s: dict[str, float] = {}  # inference that exited 0 mid-run -> when (the run may be over)
        self.restarted_s: dict[str, float] = {}  # role -> monotonic s of its exit, until it is ready again

    def pin_broker(self, endpoints: dict) -> None:
        """A restarted broker (same command) comes back where the others look for it (``pinned_broker``)."""
        self.role_files.set("broker", pinned_broker(self.role_files["broker"], endpoints))

    def pin_inference(self, served: dict, role: str = "inference") -> None:
        """A restarted inference server (or teacher) answers at the same URL (``pinned_inference``)."""
        pinned = pinned_inference(self.role_files[role], served)
        if pinned is not None:
            self.role_files.set(role, pinned)

    def look_after_starting(self) -> None:
        """While inference (and the teacher) starts: the trainer and orchestrator (started alongside) fail or restart
        as later; one that exits 0 now stops the run."""
        self.look_after_children(starting=True)

    def look_after_children(self, starting: bool = False) -> bool:
        """Deal with every child that exited since the last look: restart it (after its back-off) or stop the
        run (``ChildFailed``). Returns True when the trainer finished (exit 0)."""
        now = time.monotonic()
        for child in self.supervisor.exited():
            if self.handled_exits.get(child.name) == child.num_starts:
                continue  # waiting for its restart, or an orchestrator that finished
            code = child.poll()
            if child.name == "trainer" and code == 0 and not starting:
                return True
            if child.name == "orchestrator" and code == 0 and not starting:
                self.handled_exits[child.name] = child.num_starts
                continue  # it produced every step; the trainer is still consuming them
            if child.name in ("inference", "teacher") and code == 0 and not starting:
                # The broker tells workers the run is over once the trainer finished: its exit follows soon.
                self.handled_exits[child.name] = child.num_starts
                self.clean_exit_s.setdefault(child.name, now)
                continue
            budget = self.budgets.setdefault(child.name, RestartBudget(self.policy))
            decision = budget.decide(code, now)
            message = f"{child.name} {child.describe_exit()}"
            if starting:
                message += " while inference was starting"
            if not decision.restart:
                raise ChildFailed(
                    child,
                    message
                    if self.policy.mode == "never" or code == 0
                    else f"{message}; not restarted: {decision.reason}",
                )
            self.handled_exits[child.name] = child.num_starts
            self.pending[child.name] = now + decision.delay_s
            self.restarted_s.setdefault(child.name, now)
            self.console.end_progress_line()
            self.console.say(
                f"primerl rl: restarting {child.name} after {describe_exit_code(code)} (restart "
                f"{decision.number} of {self.policy.limit} within {self.policy.window_s:g} s) "
                f"in {decision.delay_s:g} s"
            )
            error = last_error_in_log(child.log_path) if code > 0 else None
            if error:
                self.console.say(f"  {child.name}'s last error: {error}")
        for name, exited_s in self.clean_exit_s.items():
            if now - exited_s > FINISH_WAIT_S:
                raise ChildFailed(
                    self.supervisor.children[name],
                    f"{name} exited with status 0 but the trainer has not finished {FINISH_WAIT_S:g} s later",
                )
        for name, due_s in list(self.pending.items()):
            if now >= due_s:
                del self.pending[name]
                self._restart(self.supervisor.children[name])
        self._announce_back()
        return False

    def _restart(self, child: ChildProcess) -> None:
        ready_file = READY_FILE_NAMES.get(child.name)
        if ready_file is not None:
            (self.run_dir / ready_file).unlink(missing_ok=True)
        if child.name == "trainer":
            self._resume_from_newest_checkpoint()
        self.supervisor.restart(child)
        self.supervisor.write_pids(self.run_dir / "pids.json")
        if ready_file is None:
            self.console.say(f"  {child.name} started again (pid {child.pid}, start {child.num_starts})")
            self.restarted_s.pop(child.name, None)

    def _resume_from_newest_checkpoint(self) -> None:
        """The trainer's command would resume from an explicit ``ckpt.resume_step`` again; a restart resumes from
        the newest checkpoint instead."""
        trainer = self.role_files["trainer"]
        if trainer.ckpt is None or trainer.ckpt.resume_step is None:
            return
        ckpt = trainer.ckpt.model_copy(update={"resume_step": None})
        self.role_files.set("trainer", trainer.model_copy(update={"ckpt": ckpt}))
        self.console.say("  trainer: ckpt.resume_step dropped for the restart: it resumes from its newest checkpoint")

    def _announce_back(self) -> None:
        """Say when a restarted broker or inference server is ready again, and how long after its exit."""
        for name, exited_s in list(self.restarted_s.items()):
            child = self.supervisor.children[name]
            ready_file = READY_FILE_NAMES.get(name)
            if name in self.pending or ready_file is None or not (self.run_dir / ready_file).exists():
                continue
            ready_s = time.monotonic() - child.started_s  # child.ready_s stays the first start's (the summary's)
            del self.restarted_s[name]
            self.console.say(
                f"  {name} back (start {child.num_starts}, pid {child.pid}): ready {ready_s:.1f} s "
                f"after its restart, {time.monotonic() - exited_s:.1f} s after its exit was seen"
            )
