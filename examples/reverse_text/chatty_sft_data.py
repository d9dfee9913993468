"""Make the demo's SFT data imperfect the way real SFT data is: a fraction of the answers come from a chatty
teacher that wraps the letters in words ("the letters in reverse order are : c b a").

    python examples/reverse_text/chatty_sft_data.py runs/demo/sft/clean.jsonl runs/demo/sft/data.jsonl --fraction 0.7

The input is what `primerl sft-data reverse-text` writes. The model learns both habits from SFT; the
environment's reward (LCS ratio over the answer's words) scores the extra words as mistakes, so RL has
something to fix that it can learn quickly, on top of the slow-to-learn reversal itself.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

PREAMBLE = "the letters in reverse order are :"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("input", type=Path, help="JSONL from `primerl sft-data`")
    parser.add_argument("output", type=Path, help="the JSONL to write")
    parser.add_argument("--fraction", type=float, default=0.7, help="share of chatty answers (default 0.7)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 0 <= args.fraction <= 1:
        parser.error(f"--fraction must be in [0, 1], got {args.fraction}")
    rng = random.Random(args.seed)
    rows = [json.loads(line) for line in args.input.read_text().splitlines() if line.strip()]
    num_chatty = 0
    for row in rows:
        if rng.random() < args.fraction:
            answer = row["completion"][-1]
            answer["content"] = f"{PREAMBLE} {answer['content']}"
            num_chatty += 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} samples ({num_chatty} chatty) to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
