#!/usr/bin/env python
"""Generate the Python code of the wire contracts: proto/primerl/v1/*.proto -> proto/v1/*_pb2*.py(i).

The one way generated code is produced; never edit its output by hand. protoc names imports after the
.proto paths (``from primerl.v1 import common_pb2``); the installed package is ``primerl.proto.v1``, so
those imports are rewritten. ``--check`` regenerates into a temporary folder and exits 1 when the
committed files differ (tests/test_proto_codegen.py runs it).
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_PACKAGE_DIR = PROTO_ROOT / "primerl" / "v1"
OUTPUT_DIR = PROTO_ROOT / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_IMPORT_PATTERN = re.compile(r"^from primerl\.v1 import ", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted(PROTO_PACKAGE_DIR.glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every .proto file and write the rewritten modules into ``out_dir``."""
    from grpc_tools import protoc  # dev dependency, imported only here

    with tempfile.TemporaryDirectory() as raw_dir:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={raw_dir}",
            f"--pyi_out={raw_dir}",
            f"--grpc_python_out={raw_dir}",
            *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        written = []
        out_dir.mkdir(parents=True, exist_ok=True)
        for raw in sorted((Path(raw_dir) / "primerl" / "v1").iterdir()):
            if not raw.name.endswith(GENERATED_SUFFIXES):
                continue
            text = _IMPORT_PATTERN.sub("from primerl.proto.v1 import ", raw.read_text())
            target = out_dir / raw.name
            target.write_text(text)
            written.append(target)
    return written


def committed_files() -> list[Path]:
    return sorted(p for p in OUTPUT_DIR.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def check() -> list[str]:
    """Names of generated files that would change (added, removed or different) if regenerated."""
    with tempfile.TemporaryDirectory() as fresh_dir:
        fresh = {p.name: p for p in generate(Path(fresh_dir))}
        committed = {p.name: p for p in committed_files()}
        drift = sorted(set(fresh) ^ set(committed))
        for name in sorted(set(fresh) & set(committed)):
            if not filecmp.cmp(fresh[name], committed[name], shallow=False):
                drift.append(name)
        return drift


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if regenerating would change the committed files")
    args = parser.parse_args(argv)
    if args.check:
        drift = check()
        if drift:
            print("generated code is stale; run `make proto` and commit:", ", ".join(drift), file=sys.stderr)
            return 1
        print("generated code is up to date")
        return 0
    for stale in committed_files():
        stale.unlink()
    for path in generate(OUTPUT_DIR):
        print(path.relative_to(REPO_ROOT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
