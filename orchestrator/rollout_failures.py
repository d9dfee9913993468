"""Failed rollouts are never silent: each kind is logged once with its first error and reported to the broker, and
a streak of failures as long as a step's batch stops the orchestrator with one clear error.

    failures = RolloutFailures(step_num_rollouts=64, report=control.report_error, hints=hints)
    failures.failed("BadRequestError", "This model's maximum context length is 16 tokens ...")  # per rollout
    failures.succeeded()       # a rollout that became training samples: the streak ends
    failures.check()           # raises RolloutsFailing once `step_num_rollouts` rollouts failed in a row, or
                               # no inference worker answered for `inference_outage_s`

Invariants:
- A *kind* is the failure's class: the exception type the env worker reported for a rollout
  (``BadRequestError``, ``ScoringError``...), the env-worker error of a whole group (``EnvRequestTimeout``...),
  or ``malformed_<reason>`` for a trajectory that cannot become samples.
- The first failure of a kind is logged (event ``rollout failed``, fields ``kind``, ``error``, ``count``) and sent
  to the broker's status (``report``); later ones of the same kind are only counted (``counts``, and the
  per-step ``rollout/errors/<kind>`` metrics the runner reports).
- ``consecutive`` counts rollouts failed since the last success (a group failing as a whole counts as all its
  rollouts). Stale groups cancelled by the async bound and groups dropped by the difficulty filter are neither.
- When ``consecutive`` reaches ``step_num_rollouts`` (the rollouts of one step's batch), ``check`` raises
  ``RolloutsFailing`` naming the most frequent kind of the streak, its first error and, for known causes, how
  to fix it.
- A failure whose error says the inference server could not be reached (connection refused or reset, 502/503:
  ``is_unreachable``) can heal: the server may be restarting. It is counted, logged and reported like the others
  but not added to the streak; ``failed`` returns True for it (the runner then backs off from that endpoint).
  From the first such failure after the last success a clock runs: ``waiting for an inference worker`` is logged
  every ``LOG_EVERY_S`` (by ``check``), and past ``inference_outage_s`` ``check`` raises ``RolloutsFailing``.
- Rollouts dispatched again because their inference worker could not be reached or left (``retried``) are not
  failures: they start the same clock, nothing else.
"""

from __future__ import annotations

import collections
import re
import time
from collections.abc import Callable, Sequence

from primerl.proto import telemetry
from primerl.runtime.log_setup import get_logger

log = get_logger("primerl.orchestrator.failures")

MAX_ERROR_CHARS = 600
"""Errors are cut to this length in log lines, in status and in the final error."""
LOG_EVERY_S = 5.0
"""While rollouts fail because no inference worker answers, say so this often."""
UNREACHABLE = re.compile(
    r"connection (refused|reset|aborted)|APIConnectionError|ConnectError|Connection error|RemoteProtocolError|"
    # a restarting server's port can be bound before it accepts: connecting then times out (aiohttp, httpx)
    r"ConnectTimeout|Connection timeout to host|ServerTimeoutError|"
    r"Server ?Disconnected|ClientConnectorError|Cannot connect to host|ConnectionResetError|ConnectionRefusedError|"
    r"\b50[23]\b|Service Unavailable|Bad Gateway|"
    # a server shutting down aborts its requests (vLLM's finish_reason "abort", which the OpenAI client refuses):
    # under SLURM every process of a cancelled step gets SIGTERM at once, the vLLM engine's included
    r"finish_reason[\s\S]*?input_value='abort'|"  # pydantic's message spans lines
    r"^teacher_unreachable:",
    re.IGNORECASE,
)  # the teacher: the same outage rule


class RolloutsFailing(RuntimeError):
    """A step's worth of consecutive rollouts failed: the run cannot make progress (the message says why)."""


def kind_name(kind: str) -> str:
    """A failure kind as a metric-name part: letters, digits, ``_``, ``.``, ``-``; at most 64 characters."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", kind)[:64] or "unknown"


def _cut(error: str) -> str:
    error = " ".join(str(error).split())
    return error if len(error) <= MAX_ERROR_CHARS else error[:MAX_ERROR_CHARS] + "..."


# (pattern over "kind: error", fix) -- the first match gives the hint; `{...}` are filled from `hint_values`.
KNOWN_CAUSES: Sequence[tuple[str, str]] = (
    (
        r"^teacher_.*(maximum context length|max_model_len|too many tokens)",
        "the samples (up to seq_len = {seq_len} tokens) do not fit the teacher's context: give the teacher a "
        "max_model_len of at least seq_len + 1 ([teacher.model] max_model_len)",
    ),
    (
        r"^teacher_",
        "the teacher ([orchestrator.teacher]) could not score the rollouts: is it running and reachable at its "
        "base_url (or registered with the broker as a teacher), does it serve teacher.model with the student's "
        "tokenizer, and does it take the run token (or teacher.api_key_var)?",
    ),
    (
        r"maximum context length|max_model_len|maximum model length|context length|prompt is too long|too many tokens",
        "the prompts (plus sampling.max_tokens) do not fit the inference server's context length, which is seq_len "
        "(= {seq_len}) under `primerl rl`: raise seq_len (or inference.model.max_model_len), or lower "
        "sampling.max_tokens",
    ),
    (
        r"connect(ion)? ?(error|refused)|APIConnectionError|ConnectError|Name or service not known",
        "the env worker cannot reach the inference server: is primerl-infer running, and is its address (as "
        "registered with the broker) reachable from the orchestrator's machine?",
    ),
    (
        r"\b401\b|Unauthorized|AuthenticationError",
        "the inference server refused the credentials: give the orchestrator the run's token (broker.run_token / "
        "$PRIMERL_RUN_TOKEN) that primerl-infer was started with",
    ),
    (
        r"\b404\b|NotFoundError|does not exist",
        "the inference server does not serve the orchestrator's model.name (= {model!r}): set it to the served model",
    ),
    (
        r"EnvRequestTimeout|passed its deadline",
        "rollouts take longer than rollout_timeout_s (= {rollout_timeout_s:g} s): raise it, or lower "
        "sampling.max_tokens",
    ),
    (r"^ScoringError|reward", "the environment's rubric fails: fix the environment (its first error is above)"),
)


def is_unreachable(kind: str, error: str) -> bool:
    """The failure says the inference server could not be reached (it may be restarting): it can heal."""
    return UNREACHABLE.search(f"{kind}: {error}") is not None


def hint_for(kind: str, error: str, hint_values: dict[str, object]) -> str:
    text = f"{kind}: {error}"
    for pattern, fix in KNOWN_CAUSES:
        if re.search(pattern, text, flags=re.IGNORECASE):
            try:
                return fix.format(**hint_values)
            except (KeyError, ValueError):  # a value is not known here: leave it out
                return re.sub(r" \(= \{[^}]*\}[^)]*\)", "", fix)
    return "the first error of this kind is above; fix its cause and start the run again"


class RolloutFailures:
    """Counts failed rollouts by kind and stops a run whose rollouts all fail (module docstring)."""

    def __init__(
        self,
        step_num_rollouts: int,
        *,
        report: Callable[[str], None] | None = None,
        hint_values: dict[str, object] | None = None,
        inference_outage_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if step_num_rollouts < 1:
            raise ValueError(f"step_num_rollouts must be >= 1, got {step_num_rollouts}")
        if inference_outage_s <= 0:
            raise ValueError(f"inference_outage_s must be > 0, got {inference_outage_s}")
        self.inference_outage_s = inference_outage_s
        self._clock = clock
        self.unreachable_since: float | None = None  # first "no inference worker answers" since the last success
        self._unreachable_error = ""
        self._unreachable_what = "inference worker"  # or "teacher": who did not answer first
        self._next_unreachable_log_s = 0.0
        self.step_num_rollouts = step_num_rollouts
        self._report = report
        self.hint_values = dict(hint_values or {})
        self.counts: collections.Counter[str] = collections.Counter()  # every failure of the run, by kind
        self.first_errors: dict[str, str] = {}
        self.consecutive = 0
        self._streak: collections.Counter[str] = collections.Counter()

    def failed(self, kind: str, error: str, num_rollouts: int = 1) -> bool:
        """``num_rollouts`` rollouts failed with ``kind`` (a rollout's error type, or a whole group's error).
        Returns True when the inference server could not be reached (``is_unreachable``)."""
        unreachable = is_unreachable(kind, error)
        kind = kind_name(kind)
        self.counts[kind] += num_rollouts
        if unreachable:
            if self.unreachable_since is None:
                self.unreachable_since = self._clock()
                self._unreachable_error = _cut(error)
                self._unreachable_what = "teacher" if kind.startswith("teacher_") else "inference worker"
                self._next_unreachable_log_s = self.unreachable_since + LOG_EVERY_S
        else:
            self.consecutive += num_rollouts
            self._streak[kind] += num_rollouts
        if kind not in self.first_errors:
            self.first_errors[kind] = _cut(error)
            server = "the teacher" if kind.startswith("teacher_") else "the inference server"
            hint = (
                f"{server} did not answer (restarting?): waiting for it up to {self.inference_outage_s:g} s"
                if unreachable
                else hint_for(kind, error, self.hint_values)
            )
            log.warning(
                telemetry.ROLLOUT_FAILED, kind=kind, error=self.first_errors[kind], count=self.counts[kind], hint=hint
            )
            if self._report is not None:
                self._report(f"{telemetry.ROLLOUT_FAILED} ({kind}): {self.first_errors[kind]}")
        return unreachable

    def retried(self, error: str) -> None:
        """Rollouts that could not reach their inference worker are dispatched again elsewhere: not failures (not in
        ``counts`` nor the streak), but the clock of ``inference_outage_s`` runs from the first such event since
        the last success, so that a run whose workers all stay unreachable still stops."""
        if self.unreachable_since is None:
            self.unreachable_since = self._clock()
            self._unreachable_error = _cut(error)
            self._unreachable_what = "inference worker"
            self._next_unreachable_log_s = self.unreachable_since + LOG_EVERY_S

    def succeeded(self, num_rollouts: int = 1) -> None:
        """``num_rollouts`` rollouts became training samples: the streak of failures ends."""
        if num_rollouts and self.consecutive:
            self.consecutive = 0
            self._streak.clear()
        if num_rollouts and self.unreachable_since is not None:
            log.info(telemetry.INFERENCE_WORKER_BACK, outage_s=round(self._clock() - self.unreachable_since, 1))
            self.unreachable_since = None

    def check(self) -> None:
        """Raise ``RolloutsFailing`` once a step's worth of consecutive rollouts failed, or once no inference
        worker answered for ``inference_outage_s``; meanwhile say that we wait (every ``LOG_EVERY_S``)."""
        if self.consecutive >= self.step_num_rollouts:
            raise RolloutsFailing(self.message())
        if self.unreachable_since is None:
            return
        now = self._clock()
        waited_s = now - self.unreachable_since
        if waited_s > self.inference_outage_s:
            raise RolloutsFailing(
                f"no {self._unreachable_what} answered for {waited_s:.0f} s (the orchestrator waits up to "
                f"{self.inference_outage_s:g} s); first error: {self._unreachable_error}. Fix: is primerl-infer "
                "running, and is the address it registered with the broker reachable from the orchestrator's "
                "machine?"
            )
        if now >= self._next_unreachable_log_s:
            self._next_unreachable_log_s = now + LOG_EVERY_S
            log.warning(
                telemetry.WAITING_FOR_AN_INFERENCE_WORKER,
                outage_s=round(waited_s, 1),
                budget_s=self.inference_outage_s,
                error=self._unreachable_error,
            )

    def message(self) -> str:
        kind, count = self._streak.most_common(1)[0] if self._streak else ("unknown", self.consecutive)
        others = ", ".join(f"{k} x{n}" for k, n in self._streak.most_common()[1:4])
        error = self.first_errors.get(kind, "")
        return (
            f"{self.consecutive} rollouts in a row failed (a step needs {self.step_num_rollouts}), "
            f"{count} of them with {kind}{' (also ' + others + ')' if others else ''}: {error}. "
            f"Fix: {hint_for(kind, error, self.hint_values)}"
        )


__all__ = ["KNOWN_CAUSES", "RolloutFailures", "RolloutsFailing", "hint_for", "is_unreachable", "kind_name"]
