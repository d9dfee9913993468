"""Comparing float32 training runs that differ only in how their sums are rounded (rank count, thread count,
sharding), and naming the machine whose rounding a failure shows.

`adam_weight_tolerance` bounds, element by element, how far two AdamW runs' weights can drift apart when every
gradient element differs between them by at most `grad_rounding`; the bound is large only for the elements whose
gradient sits near float32's noise floor, where AdamW's normalisation turns a rounding difference into a step.
`cpu_description` (no torch import: the report header's) and `machine_description` (with torch's kernel level and
thread count) name what decides that rounding.
"""

from __future__ import annotations

import functools
import math
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: conftest's report header imports this module and must stay light
    import torch

FLOAT32_EPS = 2.0**-23
"""torch.finfo(torch.float32).eps ~ 1.19e-7: the spacing of float32 numbers at 1."""

RL_LOSS_ATOL = 1e-5
"""How far two float32 runs' RL losses of the same step may be apart when only their summation order differs
(ranks, threads). The loss is a mean over the loss tokens of terms of order 1 at most (an advantage ~ N(0, 1) times
a truncated importance weight) that cancel in part, so its rounding scales with the terms, not with the loss: an
absolute tolerance. Each token's logprob is within an ulp or so of another summation order's (4.8e-7 at
|logprob| ~ 7 for the tiny model), and 1e-5 is 80 eps32 of the terms' scale. Measured between 1 and 2 ranks on an
Intel Xeon with AVX-512: 1.1e-7."""

VECTOR_FLAGS = ("avx2", "avx512f", "amx_tile")
"""The /proc/cpuinfo flags that decide which float32 kernels torch and oneDNN pick on x86."""


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_description() -> str:
    """The CPU without importing torch: model name (lscpu's "Model name"), CPU count, vector extensions, and the
    installed torch version."""
    from importlib.metadata import PackageNotFoundError, version

    info = _cpuinfo()
    model = info.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    flags = set(info.get("flags", "").split())
    extensions = ", ".join(flag for flag in VECTOR_FLAGS if flag in flags) or "no AVX2"
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return f"{model} ({os.cpu_count()} CPUs; {extensions}), torch {torch_version}"


def machine_description(num_threads: int | None = None) -> str:
    """One line naming what can change float32 results: `cpu_description`, torch's CPU kernel level
    (`torch.backends.cpu.get_cpu_capability()`) and the thread count (this process's unless given)."""
    import torch

    threads = f"{torch.get_num_threads()} threads in this process" if num_threads is None else f"{num_threads} threads"
    return f"{cpu_description()} with {torch.backends.cpu.get_cpu_capability()} kernels, {threads}"


def adam_ratio_bound(betas: tuple[float, float], num_steps: int) -> float:
    """The largest |m_hat| / sqrt(v_hat) over AdamW steps 1..num_steps, whatever the gradients: by Cauchy-Schwarz,
    sqrt(sum_i a_i^2 / b_i) with a_i, b_i the bias-corrected weights of gradient i in m_hat and v_hat (1.0036 for
    betas (0.9, 0.999) and 3 steps). An AdamW update moves an element by at most lr times this."""
    beta1, beta2 = betas
    bound = 0.0
    for step in range(1, num_steps + 1):
        total = 0.0
        for i in range(1, step + 1):
            a = (1 - beta1) * beta1 ** (step - i) / (1 - beta1**step)
            b = (1 - beta2) * beta2 ** (step - i) / (1 - beta2**step)
            total += a * a / b
        bound = max(bound, math.sqrt(total))
    return bound


def adam_weight_tolerance(
    weights: torch.Tensor,
    smallest_denominator: torch.Tensor,
    *,
    lr: float,
    num_steps: int,
    grad_rounding: float,
    betas: tuple[float, float] = (0.9, 0.999),
) -> torch.Tensor:
    """Per element, how far two AdamW runs' weights may differ after `num_steps` steps from the same start when
    each gradient element differs between the runs by at most `grad_rounding` (float64).

    An AdamW step moves an element by u = lr * m_hat / (s + eps), s = sqrt(v_hat); `smallest_denominator` is the
    smallest s + eps the element saw over the steps (one run's). A change of at most D in every gradient changes
    m_hat by at most D and s by at most D (both are weighted means with weights summing to 1, s a weighted
    2-norm), so to first order |du| <= lr * D / (s + eps) * (1 + r), r = `adam_ratio_bound` >= |m_hat| / s; and
    whatever the gradients, |du| <= 2 r lr (two updates of opposite signs). A common relative change of the
    gradients (the clip coefficient's rounding) cancels in m_hat / s but for eps: it moves u by less than
    lr / 4 times that relative change, below float32's rounding of the weights here. Each step also rounds
    w + u (and the weight decay), half an ulp per run: 2 * num_steps * eps32 * (|w| + lr) covers both runs.

    An element whose gradient stays well above D is held to ~2 lr D / |g| a step (2.4e-8 for |g| = 1e-5, lr 1e-3);
    one whose gradient is near zero (s + eps ~ D or less: its gradient is float32 noise) may differ by up to a
    whole step in each direction, which AdamW really does: sign(g) * lr for a g that is only rounding."""
    import torch

    ratio = adam_ratio_bound(betas, num_steps)
    per_step = lr * torch.clamp(grad_rounding * (1 + ratio) / smallest_denominator.double(), max=2 * ratio)
    rounding = 2 * num_steps * FLOAT32_EPS * (weights.double().abs() + lr)
    return num_steps * per_step + rounding


def assert_weights_match(
    reference: dict[str, torch.Tensor],
    other: dict[str, torch.Tensor],
    smallest_denominators: dict[str, torch.Tensor],
    *,
    lr: float,
    num_steps: int,
    grad_rounding: float,
    context: str,
) -> str:
    """Every tensor of `other` within `adam_weight_tolerance` of `reference`'s (whose run recorded
    `smallest_denominators`); a failure names the tensor, its worst element and `context` (the machines).
    Returns a line with the largest differences found and how close the closest element came to its bound."""
    import torch

    assert reference.keys() == other.keys() == smallest_denominators.keys(), (
        sorted(reference.keys() ^ other.keys()),
        sorted(reference.keys() ^ smallest_denominators.keys()),
    )
    max_difference = max_relative = max_excess = 0.0
    for name, expected in reference.items():
        actual = other[name]
        assert actual.shape == expected.shape and actual.dtype == expected.dtype == torch.float32, name
        tolerance = adam_weight_tolerance(
            expected, smallest_denominators[name], lr=lr, num_steps=num_steps, grad_rounding=grad_rounding
        )
        difference = (actual.double() - expected.double()).abs()
        excess = difference / tolerance
        relative = difference / expected.double().abs().clamp_min(torch.finfo(torch.float32).tiny)
        max_difference = max(max_difference, float(difference.max()))
        max_relative = max(max_relative, float(relative.max()))
        max_excess = max(max_excess, float(excess.max()))
        if bool((excess > 1).any()):
            worst = int(excess.argmax())
            raise AssertionError(
                f"{name}: {int((excess > 1).sum())} of {expected.numel()} elements differ by more than their bound; "
                f"worst at flat index {worst}: |difference| {difference.flatten()[worst]:.3g} > "
                f"{tolerance.flatten()[worst]:.3g} (weight {expected.flatten()[worst]:.6g}, smallest AdamW "
                f"denominator {smallest_denominators[name].flatten()[worst]:.3g}); tensor max |difference| "
                f"{difference.max():.3g}, max relative {relative.max():.3g}; {context}"
            )
    return (
        f"weights: max |difference| {max_difference:.3g}, max relative {max_relative:.3g}, "
        f"at most {max_excess:.3g} of an element's bound; {context}"
    )
