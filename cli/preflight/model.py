"""Preflight checks of the model and tokenizer names: a local directory that holds what it should, or a Hugging
Face id that is in the local cache (or, for vLLM alone, one it may download). The trainer loads from a directory
only (`trainer/model.py`), so its names must be directories. No network is used. A local model whose
config.json names an architecture this machine cannot serve (`trainer.tiny_families.REFUSED`) is refused with the
reason and what to use instead. ``lora_targets_check`` runs the trainer's own LoRA target check on the model
built from its config.json on the meta device (no weights read): a target the model lacks (the default list on
Phi-3's fused projections or a mixture of experts) stops the start instead of the trainer.

Without this, a missing local path reached vLLM as a repo id and failed after its start-up with
`HFValidationError: Repo id must be in the form 'repo_name'...`."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from primerl.cli.preflight.base import Check, Finding, error, warning
from primerl.trainer.tiny_families import refusal_for_architectures

Kind = Literal["model", "tokenizer"]

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tekken.json")
# huggingface_hub's rule for repo ids: one optional namespace, word characters, '-' and '.', no '--' or '..'.
HUB_ID = re.compile(r"^(?!.*(--|\.\.))[\w.-]{1,96}(/[\w.-]{1,96})?$")


def looks_like_hub_id(name: str) -> bool:
    return not name.startswith((".", "/", "~")) and HUB_ID.match(name) is not None


def hub_offline() -> bool:
    return any(
        os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def local_problem(setting: str, path: Path, kind: Kind) -> str | None:
    """What is wrong with an existing local path as a ``kind`` directory, or None."""
    if not path.is_dir():
        return f"{setting} = {str(path)!r} is a file, not a {kind} directory; give the directory that holds it"
    files = {p.name for p in path.iterdir()}
    if kind == "model":
        if "config.json" not in files:
            steps = sorted(
                (int(m.group(1)), p)
                for p in (path / "weights").glob("step_*")
                if (m := re.fullmatch(r"step_(\d+)", p.name)) and (p / "config.json").is_file()
            )
            if steps:
                return (
                    f"{setting} = {str(path)!r} is a run directory, not a model; give its exported weights, "
                    f"e.g. {steps[-1][1]}"
                )
            if "adapter_config.json" in files:
                return (
                    f"{setting} = {str(path)!r} is a LoRA adapter, not a model; give the base model (and the "
                    "adapter as a checkpoint to resume from)"
                )
            return f"{setting} = {str(path)!r} holds no config.json: not a Hugging Face model directory"
        if not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
            return f"{setting} = {str(path)!r} holds a config.json but no weights (*.safetensors, *.bin)"
        refusal = family_refusal(path / "config.json")
        if refusal is not None:
            return f"{setting} = {str(path)!r}: {refusal}"
    if kind == "tokenizer" and not files.intersection(TOKENIZER_FILES):
        return (
            f"{setting} = {str(path)!r} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}); set it "
            "to a directory with a tokenizer"
        )
    return None


def family_refusal(config_path: Path) -> str | None:
    """Why this machine cannot serve the model of ``config_path`` (its ``architectures``), or None. The refusals
    were measured on vLLM's CPU build: a machine with GPUs is not refused. An unreadable config.json is left to
    the role that loads it, which says what is wrong with it."""
    from primerl.supervisor.role_configs import has_gpus

    if has_gpus():
        return None
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    return refusal_for_architectures(architectures if isinstance(architectures, list) else None)


def cached_snapshot(name: str, kind: Kind) -> Path | None:
    """The directory of ``name`` in the local Hugging Face cache (its snapshot), or None when it is not there."""
    from huggingface_hub import try_to_load_from_cache

    for file in ("config.json",) if kind == "model" else ("tokenizer_config.json", "tokenizer.json"):
        cached = try_to_load_from_cache(name, file)
        if isinstance(cached, str):
            return Path(cached).parent
    return None


def hub_problem(setting: str, name: str, kind: Kind, *, local_only: bool) -> str | None:
    """A name that is not a local path: is it a Hugging Face id that can be loaded here? None when it can.
    ``local_only``: the role loads from a directory only (the trainer), so a hub id never does."""
    if not looks_like_hub_id(name):
        return f"{setting} = {name!r} does not exist (no {Path.cwd() / name}); give the path of a {kind} directory"
    snapshot = cached_snapshot(name, kind)
    if snapshot is not None:
        refusal = family_refusal(snapshot / "config.json") if kind == "model" else None
        if refusal is not None:
            return f"{setting} = {name!r}: {refusal}"
        if local_only:
            return (
                f"{setting} = {name!r} is a Hugging Face id, but the trainer loads from a directory only; "
                f"set {setting} to its cached copy: {snapshot}"
            )
        return None
    offline = hub_offline()
    if not (local_only or offline):
        return None  # vLLM downloads it at start
    return (
        f"{setting} = {name!r} is neither a directory (no {Path.cwd() / name}) nor a model in the Hugging Face "
        f"cache{', and downloads are off (HF_HUB_OFFLINE=1)' if offline else ''}: give the path of a {kind} "
        f"directory, or download it where there is network (`hf download {name} --local-dir DIR`) and give DIR"
    )


def name_problem(setting: str, name: str, kind: Kind, *, local_only: bool = False) -> str | None:
    path = Path(name).expanduser()
    if path.exists():
        return local_problem(setting, path, kind)
    return hub_problem(setting, name, kind, local_only=local_only)


def model_checks(
    names: Mapping[str, tuple[str | None, Kind]],
    *,
    shared_name: str | None = None,
    local_only: frozenset[str] = frozenset(),
) -> Check:
    """Check each ``{setting: (name, kind)}``; settings whose name is the run's ``shared_name`` (`[model] name`)
    are checked and reported together as ``model.name``. A setting under ``trainer.model.`` (or of a trainer's own
    config, ``local_only`` below) must be a local directory: the trainer loads nothing from the hub."""

    def check() -> list[Finding]:
        by_name: dict[tuple[str, str], set[Kind]] = {}
        local: set[tuple[str, str]] = set()
        for setting, (name, kind) in names.items():
            if name is None:
                continue
            label = "model.name" if shared_name is not None and name == shared_name else setting
            by_name.setdefault((label, name), set()).add(kind)
            if setting.startswith("trainer.model.") or setting in local_only:
                local.add((label, name))
        findings = []
        for (label, name), kinds in by_name.items():
            for kind in sorted(kinds):  # "model" before "tokenizer": a missing path is reported once
                problem = name_problem(label, name, kind, local_only=(label, name) in local)
                if problem is not None:
                    findings.append(error(problem))
                    break
        return findings

    return check


def lora_targets_check(setting: str, model_name: str | None, target_modules: list[str]) -> Check:
    """``trainer.model.lora.target_modules`` against the modules of the local model ``model_name`` (a hub id or a
    missing directory is left to the path check): the trainer's ``check_lora_targets`` on the model built on the
    meta device, ~1-3 s (importing transformers), so it runs beside the start."""

    def check() -> list[Finding]:
        path = Path(model_name).expanduser() if model_name else None
        if path is None or not (path / "config.json").is_file():
            return []
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from primerl.trainer.model import check_lora_targets

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)))
        try:
            check_lora_targets(model, list(target_modules))
        except ValueError as problem:
            return [error(f"{setting}: {problem}")]
        return []

    return check


def teacher_tokenizer_check(teacher_name: str, student_tokenizer: str | None) -> Check:
    """The teacher scores the student's token ids as they are, so both must tokenize alike: a warning when both
    are local directories whose ``tokenizer.json`` differ (hub ids and other layouts are not compared)."""

    def check() -> list[Finding]:
        if student_tokenizer is None:
            return []
        files = [Path(name).expanduser() / "tokenizer.json" for name in (teacher_name, student_tokenizer)]
        if not all(f.is_file() for f in files) or files[0].read_bytes() == files[1].read_bytes():
            return []
        return [
            warning(
                f"teacher.model.name = {teacher_name!r} has another tokenizer.json than the student's "
                f"({student_tokenizer!r}): the teacher scores the student's token ids as they are, so its "
                "logprobs are only meaningful with the same tokenizer (vocabulary and ids)"
            )
        ]

    return check
