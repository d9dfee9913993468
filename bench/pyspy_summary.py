#!/usr/bin/env python
"""Summarise py-spy raw (collapsed) stacks: the share of samples by leaf frame, or by phase under one frame.

    .venv/bin/python bench/pyspy_summary.py runs/profile/primerl-trainer.txt
    .venv/bin/python bench/pyspy_summary.py runs/profile/primerl-trainer.txt --root TrainerRunner.run \
        --phase backward --phase forward --phase Queue.get --phase Optimizer

With ``--root``, only stacks that pass through that frame count (e.g. the trainer's compute thread), and each
is put in the first ``--phase`` its stack contains (else "other: <leaf frame>").
"""

from __future__ import annotations

import argparse
import collections
import re


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--root", default=None, help="count only stacks through this frame")
    parser.add_argument("--phase", action="append", default=[], help="a frame name that names a phase (repeatable)")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    with open(args.path) as stacks:
        for line in stacks:
            stack, _, number = line.rstrip().rpartition(" ")
            if not stack or not number.isdigit() or (args.root and args.root not in stack):
                continue
            samples = int(number)
            total += samples
            phase = next((p for p in args.phase if p in stack), None)
            if phase is None:
                phase = ("other: " if args.phase else "") + re.sub(r" \(.*", "", stack.split(";")[-1])[:90]
            counts[phase] += samples
    where = f" under {args.root}" if args.root else ""
    print(f"{args.path}: {total} samples{where} ({total / 100:.1f} s at 100 Hz)")
    for name, samples in counts.most_common(args.top):
        print(f"  {100 * samples / max(total, 1):5.1f}%  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
