"""`reverse-text-v1`: primerl's reverse-text toy (`examples/reverse_text`) written for verifiers 0.4's v1 API.

Reverse a short string of letters written with spaces between them ("a c b d" -> "d b c a"). The same rows and
the same reward as the classic environment: LCS-ratio similarity between the answer and the reversed string
(0..1, reward `lcs_reward`), exact match as a metric.

- `ReverseTextTaskset` (a `vf.Taskset`): the rows, built locally from its config (nothing downloaded);
- `ReverseTextHarness` (a `vf.Harness`): one chat turn, run in-process through the rollout's interception endpoint
  (no sandbox, no program installed at the first rollout). Exported next to the taskset, so verifiers uses it as
  the taskset's default harness.

    [[orchestrator.env]]
    id = "reverse-text-v1"
    args = { num_examples = 2000, min_len = 3, max_len = 6, alphabet = "abcd" }
"""

from reverse_text_v1.harness import ReverseTextHarness, ReverseTextHarnessConfig
from reverse_text_v1.taskset import (
    ReverseTextConfig,
    ReverseTextData,
    ReverseTextTask,
    ReverseTextTaskset,
    lcs_ratio,
    make_rows,
    normalize,
)

__all__ = [
    "ReverseTextTaskset",
    "ReverseTextHarness",
    "ReverseTextConfig",
    "ReverseTextData",
    "ReverseTextTask",
    "ReverseTextHarnessConfig",
    "lcs_ratio",
    "make_rows",
    "normalize",
]
