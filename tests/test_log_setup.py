from __future__ import annotations

import io
import json
import logging

import pytest

from primerl.runtime.log_setup import bind_context, configure_logging


def test_json_lines_carry_role_run_and_bound_context():
    stream = io.StringIO()
    log = configure_logging("trainer", "run-7", fmt="json", stream=stream)
    bind_context(step=3, policy_version=2)
    log.info("step done", loss=0.5)
    logging.getLogger("vllm.engine").warning("from a library %d", 42)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines[0]["event"] == "step done" and lines[0]["loss"] == 0.5
    assert lines[1]["event"] == "from a library 42" and lines[1]["logger"] == "vllm.engine"
    for line in lines:
        assert (line["role"], line["run_id"], line["step"], line["policy_version"]) == ("trainer", "run-7", 3, 2)


def test_console_format_and_levels():
    stream = io.StringIO()
    log = configure_logging("broker", "r", fmt="console", level="warning", stream=stream)
    log.info("hidden")
    log.warning("shown", queue="rollouts")
    text = stream.getvalue()
    assert "hidden" not in text and "shown" in text and "role=broker" in text and "queue=rollouts" in text


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="log level"):
        configure_logging("broker", level="loud")
    with pytest.raises(ValueError, match="log format"):
        configure_logging("broker", fmt="xml")
