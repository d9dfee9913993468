"""PromQL against the metric names primerl exports: what the roles' /metrics expose (``exported_names``, each
family expanded the way prometheus_client exposes it: a counter as ``<base>_total``, a histogram as
``_bucket``/``_count``/``_sum``), and what a PromQL expression refers to (``parse_query``, ``query_problems``).
The Grafana dashboard's and the Prometheus rules' tests check their queries with it.

Exported names:

- every ``primerl_`` constant of ``proto/telemetry.py``, of the kind the product code makes it with. The kinds come
  from the code twice: an AST scan of the packages pyproject.toml names (``source_kinds``: calls such as
  ``exporter.counter(telemetry.X, ...)``, ``Histogram(telemetry.X, ...)``, ``GaugeMetricFamily(telemetry.X, ...)``
  or ``_Family(_COUNTER, telemetry.X, ...)``), and the families really built (``runtime_kinds``: a
  ``MetricsExporter``'s registry, ``inference_families()``, ``disk_families()``); the two must agree, and every
  constant must have a kind;
- the families of a real ``MetricsExporter`` (``primerl_step``, ``primerl_metric``, its ``ProcessCollector``'s
  ``process_*``), and Prometheus's own ``up``;
- the ``vllm:*`` families of the installed vLLM's v1 stat logger (``vllm/v1/metrics/loggers.py``), by the same scan.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
import tomllib
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path

from prometheus_client import CollectorRegistry

from primerl.proto import telemetry

REPO = Path(__file__).resolve().parents[2]

TARGET_LABELS = {"job", "instance", "role", "host", "worker", "run_id"}
"""Prometheus's own (job, instance) and those the broker's service discovery gives every target."""
FAMILY_LABELS = {
    "le",  # histogram buckets
    "name",  # primerl_metric
    "phase",  # primerl_inference_last_update_phase_ms
    "purpose",  # primerl_disk_free_bytes, primerl_disk_size_bytes
    "model_name",  # vLLM's families
    "engine",
}
LABELS = TARGET_LABELS | FAMILY_LABELS
ROLES = {"broker", "trainer", "orchestrator", "inference", "teacher", "sft"}

PROMQL_KEYWORDS = {
    "and", "or", "unless", "atan2", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
    "group_right", "inf", "nan",
}  # fmt: skip
PROMQL_FUNCTIONS = {
    # aggregations
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
    "quantile", "limitk", "limit_ratio",
    # functions
    "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "day_of_month",
    "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp", "floor", "histogram_avg",
    "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev", "histogram_stdvar",
    "histogram_sum", "holt_winters", "double_exponential_smoothing", "hour", "idelta", "increase", "irate",
    "label_join", "label_replace", "ln", "log2", "log10", "minute", "month", "predict_linear", "rate", "resets",
    "round", "scalar", "sgn", "sort", "sort_desc", "sort_by_label", "sort_by_label_desc", "sqrt", "time",
    "timestamp", "vector", "year", "avg_over_time", "min_over_time", "max_over_time", "sum_over_time",
    "count_over_time", "quantile_over_time", "stddev_over_time", "stdvar_over_time", "last_over_time",
    "present_over_time", "mad_over_time", "start", "end",
}  # fmt: skip


# -- what the roles export -----------------------------------------------------------------------------------------


def _kind_word(name: str) -> str | None:
    lowered = name.lower()
    for kind in ("histogram", "counter", "gauge", "summary"):
        if kind in lowered:
            return kind
    return None


def _callee(node: ast.Call) -> str:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _family_name(node: ast.expr, constants: dict[str, str]) -> str | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "telemetry":
        return constants.get(node.attr)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        if node.value.startswith(("primerl_", "vllm:")):
            return node.value
    return None


def scan_family_kinds(source: str, constants: dict[str, str]) -> Iterator[tuple[str, str]]:
    """(family name, kind) for each call in ``source`` that makes a family: the call (or one of its positional
    names, as ``_Family(_COUNTER, ...)``) names its kind, and an argument is a ``telemetry.X`` constant or a
    ``primerl_``/``vllm:`` string."""
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        kind = _kind_word(_callee(node))
        if kind is None:
            kind = next((_kind_word(a.id) for a in node.args if isinstance(a, ast.Name) and _kind_word(a.id)), None)
        if kind is None:
            continue
        arguments = [*node.args, *(k.value for k in node.keywords if k.arg == "name")]
        name = next((n for n in (_family_name(a, constants) for a in arguments) if n), None)
        if name is not None:
            yield name, kind


@cache
def telemetry_constants() -> dict[str, str]:
    return {key: value for key, value in vars(telemetry).items() if key.isupper() and isinstance(value, str)}


@cache
def prometheus_names() -> frozenset[str]:
    """The base names proto/telemetry.py defines."""
    return frozenset(v for v in telemetry_constants().values() if v.startswith("primerl_"))


@cache
def step_metric_keys() -> frozenset[str]:
    """The metrics.jsonl keys proto/telemetry.py defines (``train/reward``, ...; prefixes such as ``eval/`` not)."""
    return frozenset(v for v in telemetry_constants().values() if re.fullmatch(r"[a-z0-9_]+(/[a-z0-9_]+)+", v))


def product_sources() -> list[Path]:
    """The .py files of the packages pyproject.toml names (``[tool.setuptools.package-dir]``)."""
    with open(REPO / "pyproject.toml", "rb") as file:
        directories = set(tomllib.load(file)["tool"]["setuptools"]["package-dir"].values())
    return sorted({path for d in directories for path in (REPO / d).rglob("*.py")})


def vllm_stat_logger() -> Path:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    assert spec is not None and spec.submodule_search_locations, "vLLM is not installed"
    return Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "loggers.py"


def _merge_kinds(found: Iterable[tuple[str, str]]) -> tuple[dict[str, str], list[str]]:
    kinds: dict[str, str] = {}
    conflicts: list[str] = []
    for name, kind in found:
        if kinds.setdefault(name, kind) != kind:
            conflicts.append(f"{name} is made as a {kinds[name]} and as a {kind}")
    return kinds, conflicts


@cache
def source_kinds() -> tuple[dict[str, str], tuple[str, ...]]:
    """The kind of each family the product code makes (by name), and the names made with two kinds."""
    constants = telemetry_constants()
    kinds, conflicts = _merge_kinds(
        pair for path in product_sources() for pair in scan_family_kinds(path.read_text(), constants)
    )
    return kinds, tuple(conflicts)


def registry_kinds(registry: CollectorRegistry) -> dict[str, str]:
    return {metric.name: metric.type for metric in registry.collect()}


@cache
def runtime_kinds() -> dict[str, str]:
    """The families really built: a daemon's exporter before its role adds its own, the inference daemon's
    families, the disk families of the broker and the trainer."""
    from primerl.inference.metrics import inference_families
    from primerl.runtime.config_common import PrometheusConfig
    from primerl.runtime.prometheus import MetricsExporter, disk_families

    kinds = registry_kinds(MetricsExporter("trainer", PrometheusConfig()).registry)  # built, not started
    families = inference_families()
    for field in dataclasses.fields(families):
        kinds |= {metric.name: metric.type for metric in getattr(families, field.name).describe()}
    disk = disk_families("checkpoints", REPO, telemetry.DISK_FREE_BYTES, telemetry.DISK_SIZE_BYTES)
    kinds |= {metric.name: metric.type for metric in disk}
    return kinds


@cache
def family_kinds() -> tuple[dict[str, str], tuple[str, ...]]:
    """Each family's kind, from the code and the families really built, and the names whose kinds disagree."""
    scanned, conflicts = source_kinds()
    kinds, disagreements = _merge_kinds([*scanned.items(), *runtime_kinds().items()])
    return kinds, (*conflicts, *disagreements)


@cache
def vllm_kinds() -> dict[str, str]:
    kinds, _ = _merge_kinds(scan_family_kinds(vllm_stat_logger().read_text(), {}))
    return {name: kind for name, kind in kinds.items() if name.startswith("vllm:")}


def exposed(name: str, kind: str) -> set[str]:
    """The sample names prometheus_client exposes for a family (``_created`` left out: no panel needs it)."""
    if kind == "counter":
        return {f"{name.removesuffix('_total')}_total"}
    if kind == "histogram":
        return {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
    if kind == "summary":
        return {name, f"{name}_count", f"{name}_sum"}
    if kind == "info":
        return {f"{name}_info"}
    return {name}


@cache
def exported_names() -> frozenset[str]:
    """Every sample name some role's /metrics has (see the module docstring)."""
    kinds, _ = family_kinds()
    names = {"up"}
    for name in prometheus_names():
        if name in kinds:
            names |= exposed(name, kinds[name])
    for name, kind in [*runtime_kinds().items(), *vllm_kinds().items()]:
        names |= exposed(name, kind)
    return frozenset(names)


# -- PromQL --------------------------------------------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GRAFANA_VARIABLE = re.compile(r"\$(?:\{[^}]*\}|\w+)")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)?\s*\{([^{}]*)\}")
_MATCHER = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*\x00(\d+)\x01\s*(?:,|$)")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_TOKEN = re.compile(
    r"(?P<skip>\x00\d+\x01|0[xX][0-9a-fA-F]+|(?:\d+(?:ms|[smhdwy]))+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
    r"|(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)(?P<call>\s*\()?"
    r"|(?P<other>.)",
    re.DOTALL,
)


@dataclasses.dataclass(frozen=True)
class Selector:
    metric: str | None
    matchers: tuple[tuple[str, str, str], ...]  # (label, operator, value)


@dataclasses.dataclass
class Query:
    selectors: list[Selector]
    functions: set[str]
    label_names: set[str]
    errors: list[str]


def parse_query(expr: str) -> Query:
    """The vector selectors, function names and label names of a PromQL expression."""
    strings: list[str] = []

    def keep_string(match: re.Match[str]) -> str:
        strings.append(match.group()[1:-1])
        return f"\x00{len(strings) - 1}\x01"

    query = Query([], set(), set(), [])
    text = _STRING.sub(keep_string, expr)
    text = _GRAFANA_VARIABLE.sub(" ", text)  # outside strings: in ranges ([$__rate_interval]) and steps

    def grouping(match: re.Match[str]) -> str:
        query.label_names |= {label.strip() for label in match.group(2).split(",") if label.strip()}
        return " "  # the clause goes: "sum by (x) (...)" reads as "sum (...)"

    text = _GROUPING.sub(grouping, text)

    def selector(match: re.Match[str]) -> str:
        body = match.group(2)
        matchers = tuple((m[1], m[2], strings[int(m[3])]) for m in _MATCHER.finditer(body))
        if _MATCHER.sub("", body).strip():
            query.errors.append(f"label matchers not understood: {{{body}}}")
        if match.group(1) is None or any(label == "__name__" for label, _, _ in matchers):
            query.errors.append("a selector without a metric name before its braces")
        query.selectors.append(Selector(match.group(1), matchers))
        return f" {'__selector__' if match.group(1) else ''} "

    text = _SELECTOR.sub(selector, text)
    text = _RANGE.sub(" ", text)
    for token in _TOKEN.finditer(text):
        ident = token.group("ident")
        if ident is None or ident == "__selector__":
            continue
        if ident.lower() in PROMQL_KEYWORDS:  # "a and on (x) (b)" reads "a and (b)": no call
            continue
        if token.group("call"):
            query.functions.add(ident)
        else:
            query.selectors.append(Selector(ident, ()))
    for found in query.selectors:
        query.label_names |= {label for label, _, _ in found.matchers}
    return query


def metric_names(expr: str) -> set[str]:
    return {s.metric for s in parse_query(expr).selectors if s.metric}


def query_problems(
    expr: str, exported: frozenset[str], run_matcher: tuple[str, str, str] | None = ("run_id", "=", "$run_id")
) -> list[str]:
    """What in ``expr`` does not fit the exported names; with ``run_matcher``, every selector must carry it."""
    query = parse_query(expr)
    problems = list(query.errors)
    problems += [f"{name}(): not a PromQL function" for name in sorted(query.functions - PROMQL_FUNCTIONS)]
    problems += [f"label {label!r}: no target or family has it" for label in sorted(query.label_names - LABELS)]
    for found in query.selectors:
        if found.metric is None:
            continue
        if found.metric not in exported:
            problems.append(f"{found.metric}: no role exports it")
        if run_matcher is not None and run_matcher not in found.matchers:
            label, operator, value = run_matcher
            problems.append(f'{found.metric}: no {label}{operator}"{value}" matcher')
        for label, operator, value in found.matchers:
            if label == "role" and operator == "=" and value not in ROLES:
                problems.append(f"{found.metric}: role {value!r} is none of {sorted(ROLES)}")
        if found.metric == "primerl_metric":
            problems += _step_key_problems(found)
    return problems


def _step_key_problems(found: Selector) -> list[str]:
    names = [(operator, value) for label, operator, value in found.matchers if label == "name"]
    if len(names) != 1 or names[0][0] not in ("=", "=~"):
        return ['primerl_metric: one name="<metrics.jsonl key>" matcher (or name=~"a|b") is needed']
    operator, value = names[0]
    keys = value.split("|") if operator == "=~" else [value]
    unknown = [key for key in keys if key not in step_metric_keys()]
    return [f"primerl_metric: {key!r} is no step-metric key of proto/telemetry.py" for key in unknown]
