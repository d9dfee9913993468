"""Loading configs from TOML files and command-line overrides, and writing them back as TOML.

Every primerl command takes its config the same way, as prime-rl's do::

    primerl rl @ base.toml @ more.toml --orchestrator.batch-size 64 --no-orchestrator.buffer.online-difficulty-filtering
    primerl-trainer @ trainer.toml --optim.lr 1e-5

Files are read in order and merged (later files win: tables merge key by key, arrays and scalars replace);
the overrides apply after all files. Each file and the overrides go through the model's ``normalize_raw``
first (``RLConfig`` translates the three config shapes there), then the merged result is validated once.
"""

from __future__ import annotations

import copy
import datetime
import os
import re
import tomllib
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import pydantic
import tomli_w

from primerl.runtime.config_base import BaseConfig, ConfigError, validate_config

ConfigT = TypeVar("ConfigT", bound=pydantic.BaseModel)

OVERRIDES_SOURCE = "command-line overrides"
REDACTED = "<redacted>"
SECRET_KEYS = frozenset({"run_token"})


class ConfigArgs(NamedTuple):
    """What ``parse_config_args`` found on a command line."""

    files: list[Path]
    """Config files, in the order given (later ones win)."""
    overrides: dict[str, Any]
    """Nested dict of ``--dotted.key value`` settings."""
    rest: list[str]
    """Arguments that are not config: the command's own flags (``cli_flags``/``cli_options``) and positionals."""


def parse_override_value(text: str) -> Any:
    """A command-line value as a TOML value when it is one (``64``, ``1e-5``, ``[0, 1]``, ``true``, ``"x"``),
    else the text itself (``Qwen/Qwen3-4B``)."""
    try:
        value = tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text
    if isinstance(value, (datetime.date, datetime.time)):
        return text
    return value


def _is_option(token: str) -> bool:
    return token.startswith("--") and len(token) > 2


def _set_override(overrides: dict[str, Any], option: str, key: str, value: Any) -> None:
    parts = [part.replace("-", "_") for part in key.split(".")]
    if not all(parts):
        raise ConfigError(f"invalid option {option}: expected --section.key (e.g. --orchestrator.batch-size 64)")
    target = overrides
    for depth, part in enumerate(parts[:-1]):
        target = target.setdefault(part, {})
        if not isinstance(target, dict):
            raise ConfigError(f"option {option} conflicts with --{'.'.join(parts[: depth + 1])} given before it")
    target[parts[-1]] = value


def parse_config_args(
    argv: Sequence[str], *, cli_flags: Collection[str] = (), cli_options: Collection[str] = ()
) -> ConfigArgs:
    """Split a command line into config files, config overrides and the rest.

    * ``@ a.toml`` and ``@a.toml`` name config files; a bare argument ending in ``.toml`` does too.
    * ``--section.key value`` and ``--section.key=value`` set a value (dashes in keys become underscores);
      values are parsed as TOML values when possible, else kept as strings.
    * ``--section.flag`` followed by another option, by ``@`` or by nothing sets true; ``--no-section.flag``
      sets false.
    * ``cli_flags`` (e.g. ``--dry-run``) and ``cli_options`` (which take one value, e.g. ``--write DIR``) are the
      command's own options: they go to ``rest`` as given, with positionals and anything after ``--``.
    """
    files: list[Path] = []
    overrides: dict[str, Any] = {}
    rest: list[str] = []
    index = 0
    while index < len(argv):
        token = argv[index]
        index += 1
        if token == "--":
            rest.extend(argv[index:])
            break
        if token == "@":
            if index >= len(argv):
                raise ConfigError("`@` must be followed by a config file, e.g. `@ config.toml`")
            files.append(Path(argv[index]))
            index += 1
            continue
        if token.startswith("@"):
            files.append(Path(token[1:]))
            continue
        name, has_value, inline_value = token.partition("=")
        if name in cli_flags:
            rest.append(token)
            continue
        if name in cli_options:
            rest.append(token)
            if not has_value and index < len(argv):
                rest.append(argv[index])
                index += 1
            continue
        if not _is_option(token):
            (files.append(Path(token)) if token.endswith(".toml") else rest.append(token))
            continue
        key = name[2:]
        if has_value:
            value: Any = parse_override_value(inline_value)
        elif index < len(argv) and not _is_option(argv[index]) and not argv[index].startswith("@"):
            value = parse_override_value(argv[index])
            index += 1
        elif key.startswith(("no-", "no_")):
            key, value = key[3:], False
        else:
            value = True
        _set_override(overrides, name, key, value)
    return ConfigArgs(files, overrides, rest)


def read_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file; a ``ConfigError`` naming the file (and the line, for syntax errors) if that fails."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        where = "" if Path(path).is_absolute() else f" (relative to {os.getcwd()})"
        raise ConfigError(f"config file not found: {path}{where}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory, not a TOML file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {path}: {err}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(_describe_toml_error(path, text, err)) from None


def _describe_toml_error(path: Path, text: str, err: tomllib.TOMLDecodeError) -> str:
    message = str(err)
    match = re.search(r"\s*\(at line (\d+), column (\d+)\)", message)
    if match is None:
        match_end = re.search(r"\s*\(at end of document\)", message)
        reason = message[: match_end.start()] if match_end else message
        return f"invalid TOML in {path} (at the end of the file): {reason}"
    line, column = int(match.group(1)), int(match.group(2))
    reason = message[: match.start()]
    lines = text.splitlines()
    shown = lines[line - 1] if 0 < line <= len(lines) else ""
    return f"invalid TOML in {path}, line {line}, column {column}: {reason}\n  {shown}\n  {' ' * (column - 1)}^"


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``override`` on top of ``base``: tables merge recursively, arrays and scalars replace."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(merged.get(key), dict) and isinstance(value, dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _expand_dotted(overrides: Mapping[str, Any]) -> dict[str, Any]:
    expanded: dict[str, Any] = {}
    for key, value in overrides.items():
        if isinstance(value, Mapping):
            value = _expand_dotted(value)
        nested: Any = value
        for part in reversed(key.split(".")[1:]):
            nested = {part: nested}
        expanded = deep_merge(expanded, {key.split(".")[0]: nested})
    return expanded


def _normalize(cls: type, data: dict[str, Any], source: str) -> dict[str, Any]:
    if isinstance(cls, type) and issubclass(cls, BaseConfig):
        return cls.normalize_raw(data, source)
    return data


def merge_sources(cls: type, files: Sequence[Path], overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The raw (unvalidated) config: every file normalised and merged in order, then the overrides."""
    merged: dict[str, Any] = {}
    for path in files:
        merged = deep_merge(merged, _normalize(cls, read_toml(path), str(path)))
    if overrides:
        merged = deep_merge(merged, _normalize(cls, _expand_dotted(overrides), OVERRIDES_SOURCE))
    return merged


def load_config(
    cls: type[ConfigT],
    argv_or_files: Sequence[str | Path] | str | Path = (),
    overrides: Mapping[str, Any] | None = None,
) -> ConfigT:
    """Load and validate ``cls`` from a command line or a list of files, plus overrides.

    ``argv_or_files``: ``Path`` items are config files; ``str`` items are parsed as a command line
    (``["@", "a.toml", "--optim.lr", "1e-5"]``). ``overrides`` is a nested or dotted-key dict applied last.
    Raises ``ConfigError`` for every user mistake (missing file, TOML syntax, unknown key, bad value...).
    """
    if isinstance(argv_or_files, (str, Path)):
        argv_or_files = [argv_or_files]
    argv: list[str] = []
    for item in argv_or_files:
        argv.extend(["@", str(item)] if isinstance(item, Path) else [item])
    parsed = parse_config_args(argv)
    if parsed.rest:
        raise ConfigError(
            f"unexpected arguments: {' '.join(parsed.rest)}; give config files as `@ file.toml` and settings "
            "as `--section.key value`"
        )
    all_overrides = deep_merge(parsed.overrides, _expand_dotted(overrides or {}))
    raw = merge_sources(cls, parsed.files, all_overrides)
    sources = [str(f) for f in parsed.files] + ([OVERRIDES_SOURCE] if all_overrides else [])
    source = ("from " + " + ".join(sources)) if sources else None
    return validate_config(cls, raw, source=source)


def load_role_config(
    cls: type[ConfigT],
    argv: Sequence[str],
    *,
    cli_flags: Collection[str] = (),
    cli_options: Collection[str] = (),
) -> tuple[ConfigT, list[str]]:
    """For a daemon's ``main(argv)``: the validated config and the command's own arguments.

    ``primerl-trainer @ trainer.toml --optim.lr 1e-5 --check`` with ``cli_flags={"--check"}`` gives the
    ``TrainerConfig`` and ``["--check"]``; give the rest to argparse. Raises ``ConfigError``.
    """
    parsed = parse_config_args(argv, cli_flags=cli_flags, cli_options=cli_options)
    config = load_config(cls, [*parsed.files], parsed.overrides)
    return config, parsed.rest


def config_to_dict(config: pydantic.BaseModel, *, redact_secrets: bool = False) -> dict[str, Any]:
    """The config as plain TOML-ready data: field order of the model, ``None`` values dropped."""
    data = config.model_dump(mode="json", exclude_none=True)
    return _redact(data) if redact_secrets else data


def _redact(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: (REDACTED if k in SECRET_KEYS and v is not None else _redact(v)) for k, v in data.items()}
    if isinstance(data, list):
        return [_redact(v) for v in data]
    return data


def dump_toml(config: pydantic.BaseModel, *, redact_secrets: bool = False) -> str:
    """The config as TOML text that loads back into the same config."""
    return tomli_w.dumps(config_to_dict(config, redact_secrets=redact_secrets))


def write_toml(config: pydantic.BaseModel, path: Path) -> Path:
    """Write the config as TOML (readable by the owner only, since it may hold the run token)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(dump_toml(config))
    return path
