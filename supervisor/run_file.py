"""``RUN_DIR/run.json``: where a `primerl rl` run's broker answers and the run token to show it.

Written by the launcher once the broker is ready (``write_run_file``), read by ``primerl status RUN_DIR``
(``read_run_file``). The only file of a run that holds the token: created owner-only (mode 0600, from the
first byte) and replaced whole (``primerl.runtime.durable_files.write_private_atomically``).

    {"broker_address": "127.0.0.1:41235", "run_token": "...", "tls_ca_path": null, "run_id": "run-1a2b3c4d",
     "launcher_pid": 12345}

``tls_ca_path`` is absolute (``primerl status`` may run from another directory); null without TLS. With mutual TLS
``tls_cert_path`` and ``tls_key_path`` name the client certificate the launcher itself uses (the trainer's).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from primerl.runtime.durable_files import write_private_atomically
from primerl.runtime.run_files import RUN_FILE

RUN_FILE_NAME = RUN_FILE


class RunFileError(ValueError):
    """``run.json`` is missing, unreadable or not one that `primerl rl` wrote; the message says what to do."""


@dataclass(frozen=True)
class RunFile:
    broker_address: str
    run_token: str | None
    tls_ca_path: str | None = None
    run_id: str | None = None
    launcher_pid: int | None = None
    tls_cert_path: str | None = None  # a client certificate (mutual TLS), absolute; null without
    tls_key_path: str | None = None
    tls_server_name: str | None = None  # the name the broker's certificate is checked against, if not the host


def write_run_file(run_dir: Path, run: RunFile) -> Path:
    path = Path(run_dir) / RUN_FILE_NAME
    write_private_atomically(path, (json.dumps(asdict(run), indent=2) + "\n").encode())
    return path


def read_run_file(run_dir_or_file: str | os.PathLike[str]) -> RunFile:
    """The run file of a run directory (or the file itself)."""
    path = Path(run_dir_or_file)
    if path.is_dir():
        path = path / RUN_FILE_NAME
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RunFileError(
            f"{path} does not exist: give the run directory of a `primerl rl` run (its output_dir) that has "
            "started its broker, or pass --broker HOST:PORT and --token"
        ) from None
    except PermissionError:
        raise RunFileError(f"cannot read {path}: it is readable by the user who started the run only") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RunFileError(f"cannot read {path}: {err}") from None
    if not isinstance(data, dict) or not isinstance(data.get("broker_address"), str):
        raise RunFileError(f"{path} is not a run file of `primerl rl` (no broker_address)")
    fields = {key: data.get(key) for key in RunFile.__dataclass_fields__}
    return RunFile(**fields)
