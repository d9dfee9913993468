"""Base class of every primerl config model, and the translation of pydantic errors into messages for people.

A config mistake must tell the user what was wrong, where (a dotted path such as ``orchestrator.env[0].id``)
and how to fix it. ``config_error_from_validation`` turns a pydantic ``ValidationError`` into a ``ConfigError``
with one line per problem: unknown keys get a close-match suggestion found among the field names of the model
at that path, type errors say what was expected and what was given, and a table written as a scalar
(``trainer.model.ac = "full"``) gets the table syntax to use instead.
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from typing import Any, ClassVar, Literal, Union, get_args, get_origin

import pydantic
from pydantic import ConfigDict


class ConfigError(ValueError):
    """A mistake in a user's config. The message says what was wrong and how to fix it."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


class ConfigWarning(UserWarning):
    """A config that is valid but probably not what the user meant (a value with no effect, a mismatch)."""


class BaseConfig(pydantic.BaseModel):
    """Base of all config models: unknown keys are errors, defaults are validated too."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    # Example body of the table, shown when a user writes this table as a scalar (``ac = "full"``).
    table_example: ClassVar[str | None] = None

    @classmethod
    def normalize_raw(cls, data: dict[str, Any], source: str) -> dict[str, Any]:
        """Hook for the loader: turn one parsed file (or the overrides) into this model's shape before merging.

        The default keeps the data as it is; ``RLConfig`` translates the three config shapes here.
        """
        return data


def validate_config(cls: type[pydantic.BaseModel], data: dict[str, Any], source: str | None = None) -> Any:
    """``cls.model_validate(data)``, with a ``ConfigError`` instead of a pydantic ``ValidationError``."""
    try:
        return cls.model_validate(data)
    except pydantic.ValidationError as err:
        raise config_error_from_validation(err, cls, source=source) from None


def config_error_from_validation(
    err: pydantic.ValidationError, root: type, *, source: str | None = None
) -> ConfigError:
    """Turn a pydantic ``ValidationError`` raised while validating ``root`` into a readable ``ConfigError``."""
    problems = []
    for error in err.errors(include_url=False):
        described = _describe_error(error, root)
        # A root-level validator reports each cross-field problem on its own line.
        problems.extend(described.split("\n") if error["type"] == "value_error" and not error["loc"] else [described])
    problems = list(dict.fromkeys(problems))  # the same problem can be reported through several union members
    where = f" ({source})" if source else ""
    if len(problems) == 1:
        message = f"invalid config{where}: {problems[0]}"
    else:
        lines = "\n".join(f"  - {_indent_continuation(p)}" for p in problems)
        message = f"invalid config{where}: {len(problems)} problems:\n{lines}"
    return ConfigError(message, problems)


def unknown_key_message(path: str, key: str, known: typing.Iterable[str], hint: str | None = None) -> str:
    """``unknown key `a.b`; did you mean `c`?`` with a close match among ``known`` (or the list of valid keys)."""
    known = sorted(set(known))
    message = f"unknown key `{path}`"
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        message += f"; did you mean `{close[0]}`?"
    elif known:
        message += f"; valid keys here: {', '.join(known)}"
    if hint:
        message += f" ({hint})"
    return message


def toml_repr(value: Any) -> str:
    """A value as the user wrote it in TOML (strings in double quotes), shortened if long."""
    if isinstance(value, str):
        text = json.dumps(value)
    elif isinstance(value, bool):
        text = "true" if value else "false"
    else:
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def toml_type_name(value: Any) -> str:
    """The TOML name of a value's type (``string``, ``integer``, ``table``...)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "table"
    return type(value).__name__


# ---------------------------------------------------------------------------------------------------------------
# Walking the model classes along an error location.

_EXPECTED_BY_ERROR_TYPE = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer (no fractional part)",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "a boolean (true or false)",
    "bool_parsing": "a boolean (true or false)",
    "string_type": "a string",
    "list_type": "an array",
    "tuple_type": "an array",
    "dict_type": "a table",
    "path_type": "a path (string)",
    "finite_number": "a finite number",
}


def _unwrap(tp: Any) -> Any:
    """Strip ``Annotated`` and ``Optional`` (a union with ``None`` and one other member)."""
    while True:
        origin = get_origin(tp)
        if origin is typing.Annotated:
            tp = get_args(tp)[0]
            continue
        if origin in (Union, types.UnionType):
            members = [m for m in get_args(tp) if m is not type(None)]
            if len(members) == 1:
                tp = members[0]
                continue
        return tp


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, pydantic.BaseModel)


def _union_members(tp: Any) -> list[Any]:
    if get_origin(tp) in (Union, types.UnionType):
        return [_unwrap(m) for m in get_args(tp) if m is not type(None)]
    return []


def _tag_values(model: type[pydantic.BaseModel]) -> tuple[Any, ...]:
    """The ``Literal`` values of a model's ``type`` field (its tag in a discriminated union)."""
    field = model.model_fields.get("type")
    if field is None:
        return ()
    annotation = _unwrap(field.annotation)
    return get_args(annotation) if get_origin(annotation) is Literal else ()


def _step(tp: Any, item: Any) -> tuple[Any, str | None]:
    """One step along an error location: the type found there and the path segment to show (None: a union tag)."""
    tp = _unwrap(tp)
    members = _union_members(tp)
    if members and isinstance(item, str):
        for member in members:
            if _is_model(member) and item in _tag_values(member):
                return member, None
        for member in members:
            if getattr(member, "__name__", None) == item or str(member) == item:
                return member, None
        for member in members:
            if _is_model(member) and item in member.model_fields:
                return member.model_fields[item].annotation, f".{item}"
        return Any, f".{item}"
    if isinstance(item, int):
        args = get_args(tp)
        return (_unwrap(args[0]) if args else Any), f"[{item}]"
    if _is_model(tp):
        field = tp.model_fields.get(item)
        return (field.annotation if field is not None else Any), f".{item}"
    if get_origin(tp) in (dict, typing.Mapping) or tp is dict:
        args = get_args(tp)
        return (args[1] if len(args) == 2 else Any), f".{item}"
    return Any, f".{item}"


def resolve_location(root: type, loc: tuple[Any, ...]) -> tuple[str, Any]:
    """The dotted path of ``loc`` (``orchestrator.env[0].id``) and the type annotation found at its end."""
    path = ""
    tp: Any = root
    for item in loc:
        tp, segment = _step(tp, item)
        if segment is not None:
            path += segment
    return path.lstrip("."), tp


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1] in "aeiou" else f"a {noun}"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _indent_continuation(text: str) -> str:
    return text.replace("\n", "\n    ")


def _model_in(tp: Any) -> type[pydantic.BaseModel] | None:
    tp = _unwrap(tp)
    if _is_model(tp):
        return tp
    models = [m for m in _union_members(tp) if _is_model(m)]
    return models[0] if len(models) == 1 else None


def _describe_error(error: dict[str, Any], root: type) -> str:
    kind = error["type"]
    loc = tuple(error.get("loc", ()))
    value = error.get("input")
    ctx = error.get("ctx") or {}

    if kind == "extra_forbidden":
        parent_path, parent_tp = resolve_location(root, loc[:-1])
        key = str(loc[-1])
        parent = _unwrap(parent_tp)
        known: list[str] = []
        if _is_model(parent):
            known = list(parent.model_fields)
        else:
            for member in _union_members(parent):
                if _is_model(member):
                    known.extend(member.model_fields)
        return unknown_key_message(_join(parent_path, key), key, known)

    path, tp = resolve_location(root, loc)
    shown = f"`{path}`" if path else "config"

    if kind == "missing":
        field_description = _field_description(root, loc)
        text = f"missing required key `{path}`"
        return f"{text}: {field_description}" if field_description else text

    if kind == "too_short":
        field_description = _field_description(root, loc)
        text = f"{shown} needs at least {ctx.get('min_length', 1)} item(s), got {toml_repr(value)}"
        return f"{text}: {field_description}" if field_description else text

    if kind in ("model_type", "model_attributes_type", "dict_type") and not isinstance(value, dict):
        model = _model_in(tp)
        tagged = [m for m in _union_members(_unwrap(tp)) if _is_model(m) and _tag_values(m)]
        if model is None and tagged:
            tags = [str(_tag_values(m)[0]) for m in tagged]
            guess = value if value in tags else tags[0]
            others = ", ".join(toml_repr(t) for t in tags if t != guess)
            return (
                f"{shown} must be a table, not {_a(toml_type_name(value))} ({toml_repr(value)}). "
                f"Write it as a TOML table:\n  [{path}]\n  type = {toml_repr(guess)}  # or {others}"
            )
        if model is not None:
            example = model.table_example if issubclass(model, BaseConfig) else None
            if example is None:
                example = "\n".join(f"{name} = ..." for name in list(model.model_fields)[:3])
            body = "\n".join(f"  {line}" for line in example.splitlines())
            return (
                f"{shown} must be a table, not {_a(toml_type_name(value))} ({toml_repr(value)}). "
                f"Write it as a TOML table:\n  [{path}]\n{body}"
            )

    if kind == "union_tag_invalid":
        discriminator = str(ctx.get("discriminator", "type")).strip("'")
        return (
            f"`{_join(path, discriminator)}`: expected one of {ctx.get('expected_tags')}, "
            f"got {toml_repr(ctx.get('tag'))}"
        )

    if kind == "literal_error":
        text = f"{shown}: expected {ctx.get('expected')}, got {toml_repr(value)}"
        choices = [str(c) for c in get_args(_unwrap(tp))] if get_origin(_unwrap(tp)) is Literal else []
        close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.6) if choices else []
        return text + (f"; did you mean {toml_repr(close[0])}?" if close else "")

    if kind in ("value_error", "assertion_error"):
        message = str(error.get("msg", ""))
        for prefix in ("Value error, ", "Assertion failed, "):
            if message.startswith(prefix):
                message = message[len(prefix) :]
        return f"in `{path}`: {message}" if path else message

    if kind in _EXPECTED_BY_ERROR_TYPE:
        return f"{shown}: expected {_EXPECTED_BY_ERROR_TYPE[kind]}, got {toml_type_name(value)} {toml_repr(value)}"

    message = str(error.get("msg", kind))
    if message.startswith("Input should be"):
        message = "must be" + message[len("Input should be") :]
    return f"{shown}: {message} (got {toml_repr(value)})"


def _field_description(root: type, loc: tuple[Any, ...]) -> str | None:
    if not loc:
        return None
    _, parent_tp = resolve_location(root, loc[:-1])
    parent = _unwrap(parent_tp)
    if _is_model(parent) and loc[-1] in parent.model_fields:
        return parent.model_fields[loc[-1]].description
    return None


def nearest_multiples(value: int, divisor: int) -> list[int]:
    """The multiples of ``divisor`` just below and just above ``value`` (positive ones only)."""
    lower = value // divisor * divisor
    return [m for m in (lower, lower + divisor) if m > 0]


def nearest_divisors(value: int, target: int) -> list[int]:
    """The divisors of ``value`` just below and just above ``target``."""
    divisors = [d for d in range(1, value + 1) if value % d == 0]
    below = [d for d in divisors if d < target]
    above = [d for d in divisors if d > target]
    return ([below[-1]] if below else []) + ([above[0]] if above else [])
