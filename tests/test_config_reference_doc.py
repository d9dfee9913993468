"""docs/config-reference.md is generated from the config models and must match them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_config_reference_is_up_to_date():
    result = subprocess.run(
        [sys.executable, "scripts/gen_config_reference.py", "--check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_reference_documents_every_field_users_know():
    text = (REPO_ROOT / "docs" / "config-reference.md").read_text()
    for key in (
        "`batch_size`",
        "`rollouts_per_example`",
        "`keep_last`",
        "`max_model_len`",
        "`[trainer.model.lora]`",
        "`[[orchestrator.env]]`",
        "`online_difficulty_filtering`",
        "`max_async_level`",
    ):
        assert key in text, key
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    undocumented = [row.split("|")[1].strip() for row in rows if row.rstrip().endswith("|  |")]
    assert rows and not undocumented, f"fields without a description: {undocumented}"
