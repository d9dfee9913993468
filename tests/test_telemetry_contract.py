"""Telemetry as a contract: every step-metric key the dashboard's page reads by name is produced by a role.

The page (``dashboard/static/app.js``) names some keys exactly (its charts and the rollouts/s it derives); the
Python readers (``primerl status``, ``primerl plot``, the bench) use the constants of ``proto/telemetry.py``, and no
product module spells a key outside it (checked below, over every string constant of the product code but
docstrings). A key is produced when ``proto/telemetry.py`` defines it (the roles write those constants) or when the
trainer's step reports it (``train/<statistic>``, measured here on a real step of the tiny model).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch
from support.trainer_runs import packed, samples
from test_code_size import ROOT, product_files

from primerl.configs.trainer import DefaultLossConfig
from primerl.proto import telemetry
from primerl.trainer.batch import MicroBatch
from primerl.trainer.distributed import DistInfo
from primerl.trainer.train_step import TrainStep, rl_objective

PAGE = Path(__file__).resolve().parent.parent / "dashboard" / "static" / "app.js"
EXACT_KEY = re.compile(r"""["'`]([a-z_]+/[a-z0-9_/]+)["'`]""")
METRIC_KEY = re.compile(r"[a-z_]+/[a-z0-9_/]+")
DERIVED = "derived/"  # computed by the page itself from other keys


def page_keys() -> set[str]:
    """The page's quoted strings in a metric namespace (``train/...``, ``perf/...``: the prefixes of the contract's
    keys; a chart title such as "tokens/s" is in none)."""
    namespaces = {key.split("/", 1)[0] for key in contract_keys()}
    found = EXACT_KEY.findall(PAGE.read_text(encoding="utf-8"))
    return {key for key in found if key.split("/", 1)[0] in namespaces and not key.startswith(DERIVED)}


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


def test_every_key_the_dashboard_reads_is_produced(small_tiny_model: Path) -> None:
    read = page_keys()
    assert read, f"no metric key found in {PAGE}: the pattern no longer matches the page"
    missing = unproduced(read, contract_keys() | trainer_step_keys(small_tiny_model))
    assert not missing, f"{PAGE.name} reads keys no role produces: {missing} (add them to proto/telemetry.py)"


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
