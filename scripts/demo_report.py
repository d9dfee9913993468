"""Print the demo's before/after: held-out mean reward of the SFT checkpoint and of the RL run's final weights.

    python scripts/demo_report.py runs/demo/eval/sft runs/demo/eval/rl

Each argument is a `primerl eval --output` directory (its summary.json). The demo's target: RL raises the
held-out mean reward by >= 0.1 over the SFT checkpoint, or to >= 0.9.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGET_GAIN = 0.1
TARGET_REWARD = 0.9


def _summary(directory: str) -> dict:
    path = Path(directory) / "summary.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"demo_report: cannot read {path}: {exc}") from None


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    before, after = (_summary(d) for d in argv)
    gain = after["reward_mean"] - before["reward_mean"]
    met = gain >= TARGET_GAIN or after["reward_mean"] >= TARGET_REWARD

    def row(label: str, s: dict) -> str:
        exact = s["metrics"].get("exact_match")
        extra = f"  exact match {exact:.3f}" if exact is not None else ""
        return f"  {label:<16}{s['reward_mean']:.3f} ± {s['reward_std']:.3f}{extra}   ({s['model']})"

    sampling = after["sampling"]
    print(f"held-out mean reward: {after['env_id']} {after['split']} split, {after['num_examples']} prompts x "
          f"{after['rollouts_per_example']}, temperature {sampling['temperature']:g}\n"
          f"{row('SFT checkpoint', before)}\n{row('after RL', after)}\n"
          f"  change          {gain:+.3f}   target: >= +{TARGET_GAIN} or >= {TARGET_REWARD}: "
          f"{'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
