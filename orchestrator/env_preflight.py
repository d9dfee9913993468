"""The preflight's environment check, run by the orchestrator on the env workers it starts for the run, when
`primerl rl` asks for it (``$PRIMERL_ENV_CHECK``, ``runtime.start_gate``): the findings and lines of
`envs.checks` (an environment that does not load, one with no examples, prompts too long for ``seq_len`` or
``max_model_len``), without the launcher loading every environment and the tokenizer a second time beside the
run's own.

    preflight = EnvPreflight.requested(config)     # None when not asked
    preflight.start()                              # plans the check; the tokenizer loads in a thread meanwhile
    outcomes = {}
    try:
        env_clients.start_groups(groups, outcomes=outcomes)
    finally:
        preflight.report(outcomes)                 # the findings, written for the launcher's verdict
    preflight.tokenizer_loading                    # the tokenizer, for the sample rollouts (same model only)

Invariant: the report is written once the environments ended their start, whether they loaded or not, before
the orchestrator waits at the gate or exits; an error of the check itself becomes a warning, as in the launcher.
"""

from __future__ import annotations

import concurrent.futures
import functools
import traceback
from typing import Any

from primerl.orchestrator.envs.interpreters import probe_env_python
from primerl.runtime.log_setup import get_logger
from primerl.runtime.start_gate import EnvCheckRequest, env_check_request, write_env_check_report

log = get_logger("primerl.orchestrator.env_preflight")

PREFIX = "orchestrator."
"""The settings are named as in the run's config (`orchestrator.env[0]`), as the launcher's check names them."""


class EnvPreflight:
    def __init__(self, config: Any, request: EnvCheckRequest) -> None:
        self.config = config
        self.request = request
        self.tokenizer_loading: concurrent.futures.Future | None = None
        """`envs.checks.load_tokenizer`'s (tokenizer, traceback) for ``request.tokenizer``, once started."""
        self._plan: tuple[list, Any, list] | None = None
        self.probe = functools.cache(probe_env_python)
        """Lists an interpreter's environments once: the plan and the run's `EnvClients` resolve kinds alike."""

    @classmethod
    def requested(cls, config: Any) -> EnvPreflight | None:
        request = env_check_request()
        return cls(config, request) if request is not None else None

    def start(self) -> None:
        from primerl.orchestrator.envs.checks import env_plan, in_daemon_thread, load_tokenizer

        self._plan = env_plan(self.config, PREFIX, self.probe)
        if self.request.tokenizer is not None and not self._plan[2]:  # the launcher sends only a usable name
            self.tokenizer_loading = in_daemon_thread(load_tokenizer, self.request.tokenizer)

    def report(self, outcomes: dict[str, tuple[Any, Any]]) -> None:
        """Write the findings; ``outcomes``: setting -> (its env client, its `EnvInfo` or the error of its start)."""
        from primerl.runtime.findings import warning

        try:
            findings = self._findings(outcomes)
        except Exception as exc:  # noqa: BLE001 - a bug of the check, not of the config: reported, never fatal
            findings = [
                warning(
                    f"the environments check could not run ({type(exc).__name__}: {exc}); starting without it",
                    traceback.format_exc(),
                )
            ]
        write_env_check_report(
            self.request.report_path,
            [{"message": f.message, "error": f.error, "detail": f.detail} for f in findings],
        )
        log.info(
            "environments checked",
            num_errors=sum(f.error for f in findings),
            num_warnings=sum(not f.error for f in findings),
            report=self.request.report_path,
        )

    def _findings(self, outcomes: dict[str, tuple[Any, Any]]) -> list:
        from primerl.orchestrator.envs.checks import LoadedEnv, check_planned, load_env, sampled_prompts

        assert self._plan is not None, "report() before start()"

        def loaded(use, python: str) -> LoadedEnv:
            if use.setting not in outcomes:  # the start ended before this one began (an error building it)
                return load_env(use, python)
            client, outcome = outcomes[use.setting]
            if isinstance(outcome, BaseException):
                return LoadedEnv(use, [], 0, outcome, client.stderr_tail())
            return sampled_prompts(use, client, outcome)

        return check_planned(
            self.config,
            self._plan,
            prefix=PREFIX,
            tokenizer=self.request.tokenizer if self.tokenizer_loading is not None else None,
            max_model_len=self.request.max_model_len,
            load=loaded,
            loaded_tokenizer=self.tokenizer_loading,
        )

    def tokenizer_of(self, model_name: str) -> concurrent.futures.Future | None:
        """The tokenizer being loaded, when it is ``model_name``'s (the sample rollouts decode with it)."""
        return self.tokenizer_loading if self.request.tokenizer == model_name else None
