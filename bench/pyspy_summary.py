#!/usr/bin/env python
"""Summarise py-spy raw (collapsed) stacks: the share of samples by leaf frame, or by phase under one frame.

    .venv/bin/python bench/pyspy_summary.py runs/profile/primerl-trainer.txt
    .venv/bin/python bench/pyspy_summary.py runs/profile/primerl-trainer.txt --root TrainerRunner.run \
        --phase backward --phase forward --phase Queue.get --phase Optimizer

With ``--root``, only stacks that pass through that frame count (e.g. the trainer's compute thread), and each
is put in the first ``--phase`` its stack contains (else "other: <leaf frame>").

``--active`` drops the samples of threads that were waiting: a leaf frame in `WAIT_LEAVES` (poll, epoll_wait,
select, Condition.wait, a thread pool's idle ``_worker``, a blocking read...) or an unresolved native address
(with ``--native`` those are mostly futex waits inside libpython). ``--inclusive`` ranks frames by the share of
samples they appear in (their own time and their callees'), which shows where a request's CPU goes
(``--inclusive --active`` on the env worker: ``AsyncAPIClient.post``, ``MultiTurnEnv.rollout``...).
"""

from __future__ import annotations

import argparse
import collections
import re

WAIT_LEAVES = frozenset(
    {
        "poll",
        "epoll_wait",
        "select",
        "EpollSelector.select",
        "Condition.wait",
        "_worker",
        "serve.<locals>.read_stdin",
        "read",
        "recv",
        "wait",
        "pthread_cond_wait",
        "pthread_cond_timedwait",
        "sem_wait",
        "nanosleep",
        "clock_nanosleep",
    }
)
"""Leaf frames of a waiting thread (``--active`` drops their samples)."""


def is_waiting(leaf: str) -> bool:
    return leaf in WAIT_LEAVES or leaf.startswith("0x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--root", default=None, help="count only stacks through this frame")
    parser.add_argument("--phase", action="append", default=[], help="a frame name that names a phase (repeatable)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--active", action="store_true", help="drop the samples of waiting threads")
    parser.add_argument("--inclusive", action="store_true", help="rank frames by the samples they appear in")
    parser.add_argument("--rate", type=float, default=100.0, help="the sampling rate of the recording (Hz)")
    args = parser.parse_args(argv)
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    with open(args.path) as stacks:
        for line in stacks:
            stack, _, number = line.rstrip().rpartition(" ")
            if not stack or not number.isdigit() or (args.root and args.root not in stack):
                continue
            frames = [re.sub(r" \(.*", "", frame) for frame in stack.split(";")]
            if args.active and is_waiting(frames[-1]):
                continue
            samples = int(number)
            total += samples
            if args.inclusive:
                for frame in dict.fromkeys(frames):
                    counts[frame[:90]] += samples
                continue
            phase = next((p for p in args.phase if p in stack), None)
            if phase is None:
                phase = ("other: " if args.phase else "") + re.sub(r" \(.*", "", stack.split(";")[-1])[:90]
            counts[phase] += samples
    where = (f" under {args.root}" if args.root else "") + (" of running threads" if args.active else "")
    print(f"{args.path}: {total} samples{where} ({total / args.rate:.1f} s at {args.rate:g} Hz)")
    for name, samples in counts.most_common(args.top):
        print(f"  {100 * samples / max(total, 1):5.1f}%  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
