"""What every command does with its arguments: parse them, turning argparse's exits into an exit status, and
show the config's warnings as ``warning: ...`` lines on stderr."""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Iterator, Sequence


def parse_command_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace | int:
    """``parser.parse_args(argv)`` (``sys.argv[1:]`` when None), or the exit status when argparse exits instead:
    0 after ``--help``, 2 after a usage error (both already printed by argparse)."""
    try:
        return parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exit_:
        return int(exit_.code or 0)


@contextlib.contextmanager
def config_warnings_printed() -> Iterator[None]:
    """Collect the ``ConfigWarning``s raised inside (each, even a repeat) and print them on stderr once the block
    succeeded (a ``ConfigError`` out of it is the message to show instead)."""
    from primerl.runtime.config_base import ConfigWarning  # pydantic: only for the commands that load a config

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        yield
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
