"""Run by the environments' interpreter (not imported by primerl): what it has installed, as one JSON object.

    <env python> env_probe.py   ->   {"python": ..., "verifiers": "0.3.1" | null,
                                      "envs": [{"id", "module", "dist", "version", "editable_path",
                                                "kind"}, ...]}

Standard library only: the interpreter that runs it has verifiers 0.3.x and not primerl's dependencies. An
environment is a top-level module of an installed distribution whose source names `load_environment` (the
verifiers convention: id `reverse-text` is module `reverse_text`, `vf.load_environment` imports it). The module
is found (`importlib.util.find_spec`) and its source read, never imported: listing runs no environment code.
A verifiers v1 environment (verifiers 0.4: `kind` "v1", the others "classic") is a top-level module whose source
exports a Taskset or Harness class in `__all__`, or one of a distribution that requires verifiers>=0.4.
"""

from __future__ import annotations

import os
import sys

# `python env_probe.py` puts this file's folder first on sys.path: its siblings must not shadow installed modules.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import importlib.metadata
import importlib.util
import json
import re

LOADER_PATTERN = re.compile(r"\bload_environment\b")
V1_EXPORT_PATTERN = re.compile(r"__all__\s*=\s*[\[(][^\])]*\w*(Taskset|Harness)\b", re.S)
V1_REQUIREMENT_PATTERN = re.compile(r"^verifiers\b[^;]*(>=|==|~=)\s*0\.([4-9]|\d\d)", re.I)
MAX_SOURCE_BYTES = 1 << 20
SKIP_DISTRIBUTIONS = {"verifiers"}  # re-exports `load_environment`; it is the loader, not an environment


def _top_level_names(dist: importlib.metadata.Distribution) -> set[str]:
    names = {line.strip() for line in (dist.read_text("top_level.txt") or "").splitlines() if line.strip()}
    for file in dist.files or ():
        first = file.parts[0]
        if len(file.parts) == 1 and first.endswith(".py") and not first.startswith("__editable__"):
            names.add(first[:-3])
        elif len(file.parts) > 1 and first.isidentifier() and first != "__pycache__":
            names.add(first)
    names.add(re.sub(r"[-.]+", "_", dist.metadata["Name"] or "").lower())
    return {name for name in names if name.isidentifier()}


def _module_source(module: str) -> str | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, "origin", None) if spec is not None else None
    if not origin or not origin.endswith(".py") or not os.path.isfile(origin):
        return None
    with open(origin, "rb") as source:
        return source.read(MAX_SOURCE_BYTES).decode("utf-8", "replace")


def _requires_verifiers_v1(dist: importlib.metadata.Distribution) -> bool:
    return any(V1_REQUIREMENT_PATTERN.search(req) for req in dist.requires or ())


def _env_kind(module: str, requires_v1: bool) -> str | None:
    """ "classic" (names `load_environment`), "v1" (exports a Taskset/Harness, or its distribution requires
    verifiers>=0.4 and it is the distribution's module), or None: not an environment."""
    source = _module_source(module)
    if source is None:
        return None
    if V1_EXPORT_PATTERN.search(source):
        return "v1"
    if LOADER_PATTERN.search(source):
        return "classic"
    return "v1" if requires_v1 else None


def _editable_path(dist: importlib.metadata.Distribution) -> str | None:
    try:
        direct_url = json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        return None
    if direct_url.get("dir_info", {}).get("editable") and direct_url.get("url", "").startswith("file://"):
        return direct_url["url"][len("file://") :]
    return None


def probe() -> dict:
    envs, seen = [], set()
    verifiers_version = None
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or ""
        if name.lower() == "verifiers":
            verifiers_version = verifiers_version or dist.version
        if name.lower() in SKIP_DISTRIBUTIONS:
            continue
        requires_v1 = _requires_verifiers_v1(dist)
        for module in sorted(_top_level_names(dist)):
            kind = None if module in seen else _env_kind(module, requires_v1)
            if kind is None:
                continue
            seen.add(module)
            envs.append(
                {
                    "id": module.replace("_", "-"),
                    "module": module,
                    "dist": name,
                    "version": dist.version,
                    "editable_path": _editable_path(dist),
                    "kind": kind,
                }
            )
    envs.sort(key=lambda env: env["id"])
    return {"python": sys.executable, "verifiers": verifiers_version, "envs": envs}


if __name__ == "__main__":
    json.dump(probe(), sys.stdout)
    sys.stdout.write("\n")
