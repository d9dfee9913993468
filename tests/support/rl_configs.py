"""Whole-run configs for the config tests: a base file in each of the three shapes users write (``BASE``: prime-rl's,
``LAB``, ``VF_RL``), a writer of TOML files into a test's directory, and loading them (``load``, ``error_of``)."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from primerl.configs.rl import RLConfig
from primerl.runtime.config_base import ConfigError
from primerl.runtime.config_loader import load_config

BASE = """
inference_gpu_ids = [0]
trainer_gpu_ids = [1]
max_steps = 10
seq_len = 1024

[model]
name = "tiny-model"

[orchestrator]
batch_size = 16
rollouts_per_example = 4

[[orchestrator.env]]
id = "reverse-text"
args = { max_len = 8 }
"""

LAB = """
model = "tiny-model"
batch_size = 16
rollouts_per_example = 4

[[env]]
id = "reverse-text"
"""

VF_RL = """
model = "tiny-model"

[env]
id = "reverse-text"

[trainer.args]
batch_size = 16
rollouts_per_example = 4
"""


def config_writer(directory: Path) -> Callable[[str, str], Path]:
    """``write(name, text)``: ``text`` (dedented) as the file ``directory/name``; returns its path."""

    def write(name: str, text: str) -> Path:
        path = directory / name
        path.write_text(textwrap.dedent(text))
        return path

    return write


def load(*argv: str | Path, **overrides) -> RLConfig:
    return load_config(RLConfig, [str(a) if isinstance(a, Path) else a for a in argv], overrides or None)


def error_of(*argv: str | Path) -> str:
    with pytest.raises(ConfigError) as info:
        load("@", *argv) if argv and isinstance(argv[0], Path) else load(*argv)
    return str(info.value)
