"""`primerl rl`'s restarts of its roles (part of ``primerl.cli.launcher.Launcher``): the ports a role bound at
its first start pinned in its config, so that a restart with the same command comes back where the others look
for it, and the look after the children that restarts a dead role (``primerl.cli.restart_policy``) or stops the
run (``ChildFailed``).

``RestartsMixin`` uses the launcher's ``supervisor``, ``options``, ``roles``, ``paths``, ``run_dir``, the
restart bookkeeping (``restart_budgets``, ``pending_restarts``, ``handled_exits``, ``clean_exit_s``,
``restarted_s``) and ``say``.
"""

from __future__ import annotations

import time

from primerl.cli.process_supervisor import ChildFailed, ChildProcess
from primerl.cli.restart_policy import RestartBudget, describe_exit_code
from primerl.cli.role_configs import pinned_broker, pinned_inference, without_token
from primerl.cli.role_logs import last_error_in_log
from primerl.proto.ready_file import READY_FILE_NAMES
from primerl.runtime.config_loader import write_toml

FINISH_WAIT_S = 60.0
"""How long an inference worker (or teacher) that exited 0 (the broker said the run is over) may precede the
trainer's exit."""


class RestartsMixin:
    """Pinning and restarts of ``Launcher`` (see the module docstring)."""

    def _pin_broker(self, endpoints: dict) -> None:
        """A restarted broker (same command) comes back where the others look for it (``pinned_broker``)."""
        self.roles["broker"] = pinned_broker(self.roles["broker"], endpoints)
        write_toml(without_token(self.roles["broker"]), self.paths["broker"])

    def _pin_inference(self, served: dict, role: str = "inference") -> None:
        """A restarted inference server (or teacher) answers at the same URL (``pinned_inference``)."""
        pinned = pinned_inference(self.roles[role], served)
        if pinned is not None:
            self.roles[role] = pinned
            write_toml(without_token(pinned), self.paths[role])

    def _look_after_starting(self) -> None:
        """While inference (and the teacher) starts: the trainer and orchestrator (started alongside) fail or restart
        as later; one that exits 0 now stops the run."""
        self._look_after_children(starting=True)

    def _look_after_children(self, starting: bool = False) -> bool:
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
            budget = self.restart_budgets.setdefault(child.name, RestartBudget(self.options.restart))
            decision = budget.decide(code, now)
            message = f"{child.name} {child.describe_exit()}"
            if starting:
                message += " while inference was starting"
            if not decision.restart:
                raise ChildFailed(child, message if self.options.restart.mode == "never" or code == 0
                                  else f"{message}; not restarted: {decision.reason}")
            self.handled_exits[child.name] = child.num_starts
            self.pending_restarts[child.name] = now + decision.delay_s
            self.restarted_s.setdefault(child.name, now)
            if self.is_tty:
                self.out.write("\n")
            self.say(f"primerl rl: restarting {child.name} after {describe_exit_code(code)} (restart "
                     f"{decision.number} of {self.options.restart.limit} within {self.options.restart.window_s:g} s) "
                     f"in {decision.delay_s:g} s")
            error = last_error_in_log(child.log_path) if code > 0 else None
            if error:
                self.say(f"  {child.name}'s last error: {error}")
        for name, exited_s in self.clean_exit_s.items():
            if now - exited_s > FINISH_WAIT_S:
                raise ChildFailed(self.supervisor.children[name], f"{name} exited with status 0 but the trainer has "
                                  f"not finished {FINISH_WAIT_S:g} s later")
        for name, due_s in list(self.pending_restarts.items()):
            if now >= due_s:
                del self.pending_restarts[name]
                self._restart(self.supervisor.children[name])
        self._announce_back()
        return False

    def _restart(self, child: ChildProcess) -> None:
        ready_file = READY_FILE_NAMES.get(child.name)
        if ready_file is not None:
            (self.run_dir / ready_file).unlink(missing_ok=True)
        ckpt = getattr(self.roles["trainer"], "ckpt", None) if child.name == "trainer" else None
        if ckpt is not None and ckpt.resume_step is not None:
            # The same command would resume from that step again; a restart resumes from the newest checkpoint.
            self.roles["trainer"] = self.roles["trainer"].model_copy(
                update={"ckpt": ckpt.model_copy(update={"resume_step": None})})
            write_toml(without_token(self.roles["trainer"]), self.paths["trainer"])
            self.say("  trainer: ckpt.resume_step dropped for the restart: it resumes from its newest checkpoint")
        self.supervisor.restart(child)
        self.supervisor.write_pids(self.run_dir / "pids.json")
        if ready_file is None:
            self.say(f"  {child.name} started again (pid {child.pid}, start {child.num_starts})")
            self.restarted_s.pop(child.name, None)

    def _announce_back(self) -> None:
        """Say when a restarted broker or inference server is ready again, and how long after its exit."""
        for name, exited_s in list(self.restarted_s.items()):
            child = self.supervisor.children[name]
            ready_file = READY_FILE_NAMES.get(name)
            if name in self.pending_restarts or ready_file is None or not (self.run_dir / ready_file).exists():
                continue
            ready_s = time.monotonic() - child.started_s  # child.ready_s stays the first start's (the summary's)
            del self.restarted_s[name]
            self.say(f"  {name} back (start {child.num_starts}, pid {child.pid}): ready {ready_s:.1f} s "
                     f"after its restart, {time.monotonic() - exited_s:.1f} s after its exit was seen")
