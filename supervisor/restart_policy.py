"""When `primerl rl` starts a dead role again: systemd's ``Restart=on-failure`` with its limits, as pure logic.

- ``mode = "on-failure"``: a role that exits non-zero or is killed by a signal is started again with the same
  command; ``"never"``: any such exit stops the run.
- Exit status 2 is never restarted (like systemd's ``RestartPreventExitStatus=``): every primerl daemon exits 2
  for a configuration or data problem the user must fix, which the same command would only hit again.
- At most ``limit`` restarts of one role within ``window_s`` (``StartLimitBurst`` / ``StartLimitIntervalSec``);
  one more failure inside the window stops the run.
- Back-off (``RestartSec``, doubling as in ``RestartSteps``/``RestartMaxDelaySec``): the n-th restart within the
  window waits ``min(delay_s * 2 ** (n - 1), max_delay_s)`` after the exit.
"""

from __future__ import annotations

import collections
import signal
from dataclasses import dataclass
from typing import Literal

RestartMode = Literal["on-failure", "never"]
RESTART_MODES: tuple[RestartMode, ...] = ("on-failure", "never")
NO_RESTART_EXIT_CODES = frozenset({2})
"""Exit statuses that say "restarting will not help" (a primerl daemon's configuration or data error)."""


@dataclass(frozen=True)
class RestartPolicy:
    mode: RestartMode = "on-failure"
    limit: int = 5
    """Most restarts of one role within ``window_s``."""
    window_s: float = 300.0
    delay_s: float = 1.0
    """Wait before the first restart within the window; doubled for each further one."""
    max_delay_s: float = 30.0

    def __post_init__(self) -> None:
        if self.mode not in RESTART_MODES:
            raise ValueError(f"restart mode must be one of {', '.join(RESTART_MODES)}, got {self.mode!r}")
        if self.limit < 1:
            raise ValueError(f"the restart limit must be >= 1 (or use --restart never), got {self.limit}")
        if not self.window_s > 0:
            raise ValueError(f"the restart window must be > 0 s, got {self.window_s:g}")
        if not 0 <= self.delay_s <= self.max_delay_s:
            raise ValueError(
                f"restart delays must satisfy 0 <= delay ({self.delay_s:g} s) <= max delay ({self.max_delay_s:g} s)"
            )


def describe_exit_code(code: int) -> str:
    """``exit code 3`` or ``signal SIGKILL`` (a ``Popen.returncode``)."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def is_failure(code: int) -> bool:
    return code != 0


@dataclass(frozen=True)
class RestartDecision:
    restart: bool
    number: int = 0
    """This restart's number within the window (1-based), when ``restart``."""
    delay_s: float = 0.0
    reason: str = ""
    """Why not, when not ``restart``."""


class RestartBudget:
    """The restarts of one role: ``decide(code, now_s)`` says whether (and after how long) to start it again,
    and counts the restart when it says yes."""

    def __init__(self, policy: RestartPolicy):
        self.policy = policy
        self.restart_times_s: collections.deque[float] = collections.deque()
        self.num_restarts = 0  # over the whole run

    def decide(self, code: int, now_s: float) -> RestartDecision:
        policy = self.policy
        if policy.mode == "never":
            return RestartDecision(False, reason="--restart never")
        if not is_failure(code):
            return RestartDecision(False, reason="it exited 0")
        if code in NO_RESTART_EXIT_CODES:
            return RestartDecision(
                False, reason=f"exit code {code} means a configuration or data error that a restart would hit again"
            )
        while self.restart_times_s and now_s - self.restart_times_s[0] >= policy.window_s:
            self.restart_times_s.popleft()
        if len(self.restart_times_s) >= policy.limit:
            return RestartDecision(
                False,
                reason=f"it was restarted {len(self.restart_times_s)} times within "
                f"{policy.window_s:g} s (--restart-limit {policy.limit})",
            )
        number = len(self.restart_times_s) + 1
        self.restart_times_s.append(now_s)
        self.num_restarts += 1
        delay_s = min(policy.delay_s * 2 ** (number - 1), policy.max_delay_s)
        return RestartDecision(True, number=number, delay_s=delay_s)
