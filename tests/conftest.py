"""Fixtures shared by several test modules (more move here with issue 16)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def no_wandb_login(tmp_path, monkeypatch) -> Path:
    """A machine without a W&B login: no key in the environment, an empty home (no ~/.netrc, no settings)."""
    home = tmp_path / "home"
    home.mkdir()
    for variable in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "NETRC", "WANDB_CONFIG_DIR",
                     "WANDB_BASE_URL"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(home))
    return home
