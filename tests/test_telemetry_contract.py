"""Telemetry as a contract: every step-metric key the dashboard draws is produced by a role.

The dashboard's charts are a table on the server (``dashboard/charts.py``, served as ``/api/charts``) naming the keys
by ``proto/telemetry.py``'s constants; the page (``dashboard/static/app.js``) spells no key itself. The Python readers
(``primerl status``, ``primerl plot``, the bench) use the same constants, and no product module spells a key outside
``proto/telemetry.py`` (checked below, over every string constant of the product code but docstrings). A key is
produced when the trainer's step reports it (``train/<statistic>``, measured here on a real step of the tiny model),
when an orchestrator component writes it (the filter's reasons, an environment's ``env/<id>/...``), or when
``proto/telemetry.py`` defines it as a key the roles write.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch
from support.trainer_runs import packed, samples
from test_code_size import ROOT, product_files

from primerl.configs.trainer import DefaultLossConfig
from primerl.dashboard.charts import chart_table
from primerl.orchestrator.filtering import FILTER_REASONS
from primerl.proto import telemetry
from primerl.trainer.batch import MicroBatch
from primerl.trainer.distributed import DistInfo
from primerl.trainer.train_step import TrainStep, rl_objective

PAGE = Path(__file__).resolve().parent.parent / "dashboard" / "static" / "app.js"
EXACT_KEY = re.compile(r"""["'`]([a-z_]+/[a-z0-9_/]+)["'`]""")
METRIC_KEY = re.compile(r"[a-z_]+/[a-z0-9_/]+")


def page_keys() -> set[str]:
    """The page's quoted strings in a metric namespace (``train/...``, ``perf/...``: the prefixes of the contract's
    keys; a chart title such as "tokens/s" is in none)."""
    namespaces = {key.split("/", 1)[0] for key in contract_keys()}
    found = EXACT_KEY.findall(PAGE.read_text(encoding="utf-8"))
    return {key for key in found if key.split("/", 1)[0] in namespaces}


def chart_reads() -> tuple[set[str], list[str]]:
    """(the exact keys, the patterns) the dashboard's charts and derived series read."""
    table = chart_table()
    series = [s for chart in table["charts"] for s in chart["series"]]
    derived = {d["key"] for d in table["derived"]}
    keys = {s["key"] for s in series if "key" in s and s["key"] not in derived}
    keys |= {d[side] for d in table["derived"] for side in ("numerator", "denominator")}
    return keys, [s["pattern"] for s in series if "pattern" in s]


def contract_keys() -> set[str]:
    return {v for k, v in vars(telemetry).items() if k.isupper() and isinstance(v, str) and "/" in v}


def trainer_step_keys(model_dir: Path) -> set[str]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    objective = rl_objective(DefaultLossConfig())
    step = TrainStep(model, optimizer, scheduler, objective, DistInfo(0, 1, 0, None), max_grad_norm=1.0)
    return set(step.step(1, [MicroBatch.from_tensors(packed(samples(0)[:4]))]).as_metrics())


def unproduced(read: set[str], produced: set[str]) -> list[str]:
    return sorted(read - produced)


def produced_keys(model_dir: Path) -> set[str]:
    orchestrator = {telemetry.FILTER_PREFIX + reason for reason in FILTER_REASONS}
    orchestrator |= {f"{prefix}some-env/reward" for prefix in (telemetry.ENV_PREFIX, telemetry.EVAL_PREFIX)}
    return contract_keys() | trainer_step_keys(model_dir) | orchestrator


def test_every_key_the_dashboard_reads_is_produced(small_tiny_model: Path) -> None:
    keys, patterns = chart_reads()
    assert keys and patterns, "the chart table names no key or no pattern: chart_reads() no longer reads it"
    produced = produced_keys(small_tiny_model)
    missing = unproduced(keys, produced)
    assert not missing, f"the dashboard's charts read keys no role produces: {missing} (dashboard/charts.py)"
    dead = [p for p in patterns if not any(re.search(p, key) for key in produced)]
    assert not dead, f"chart patterns that match no produced key: {dead} (dashboard/charts.py)"


def test_the_page_spells_no_metric_key() -> None:
    assert not page_keys(), f"{PAGE.name} names metric keys itself: {sorted(page_keys())}; add them to charts.py"


def test_the_check_can_fail() -> None:
    assert unproduced({"train/not_a_metric", telemetry.TRAIN_LOSS}, contract_keys()) == ["train/not_a_metric"]


def key_literals(source: str, namespaces: set[str]) -> list[tuple[int, str]]:
    """(line, text) of the string constants of ``source`` that are metric keys, docstrings left out."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and METRIC_KEY.fullmatch(node.value)
        and node.value.split("/", 1)[0] in namespaces
    ]


def test_no_product_module_spells_a_metric_key_outside_telemetry() -> None:
    namespaces = {key.split("/", 1)[0] for key in contract_keys()}
    found = [
        f"{path.relative_to(ROOT)}:{line}: {text!r}"
        for path in product_files()
        if path.name != "telemetry.py"
        for line, text in key_literals(path.read_text(encoding="utf-8"), namespaces)
    ]
    assert not found, "metric keys spelled outside proto/telemetry.py (use its constants):\n" + "\n".join(found)
    assert key_literals('x = {"train/loss": 1.0}\n', namespaces) == [(1, "train/loss")]  # the check can fail


PRODUCERS = ("broker", "client", "inference", "orchestrator", "runtime", "supervisor", "trainer")


def unwritten(keys: dict[str, str], sources: list[str], step_keys: set[str]) -> list[str]:
    """The constants of ``keys`` (name -> key) that no producer source names and no real step reports (a step's
    statistic that only some runs have, such as ``train/teacher_kl``, counts when a producer names it in quotes)."""

    def named(name: str, key: str) -> bool:
        leaf = f'"{key.split("/", 1)[1]}"' if key.startswith("train/") else None
        return any(re.search(rf"\b{name}\b", source) or (leaf and leaf in source) for source in sources)

    return sorted(name for name, key in keys.items() if key not in step_keys and not named(name, key))


def test_every_step_metric_key_of_the_contract_has_a_writer(small_tiny_model: Path) -> None:
    """What ``primerl status``, ``primerl plot`` and the bench read are these constants: each one is written by a
    role (named in a producer package's code) or reported by a real trainer / SFT step."""
    keys = {k: v for k, v in vars(telemetry).items() if k.isupper() and isinstance(v, str) and "/" in v}
    keys.pop("DERIVED_ROLLOUTS_PER_S")  # the dashboard's page computes it (dashboard/charts.py)
    sources = [
        path.read_text(encoding="utf-8")
        for package in PRODUCERS
        for path in (ROOT / package).rglob("*.py")
        if "_pb2" not in path.name
    ]
    step = trainer_step_keys(small_tiny_model)
    step |= {"sft/" + key.split("/", 1)[1] for key in step}  # the SFT runner reports the same step as sft/<name>
    missing = unwritten(keys, sources, step)
    assert not missing, f"proto/telemetry.py keys no role writes: {missing} (write them, or drop the constant)"
    assert unwritten({"X_UNWRITTEN": "x/unwritten"}, sources, step) == ["X_UNWRITTEN"]  # the check can fail
