"""`primerl generate MODEL_DIR`: sample from a model with an in-process vLLM engine, show the completions with
their logprobs and throughput, and optionally check vLLM's logprobs against a transformers forward pass."""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from primerl.cli.command_args import parse_command_args

LOGPROB_TOLERANCE = 1e-4
DEFAULT_PROMPTS = (
    "Reverse the string: a b c d",
    "What is 12 plus 30?",
    "Say something about the sea.",
    "Count from 1 to 5.",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="primerl generate",
        description="Sample completions from MODEL_DIR with vLLM (in process) and print them with per-token "
        "logprob summaries and tokens/s. With --check-logprobs, recompute the logprobs of the sampled tokens "
        f"with transformers (float32) and exit 1 if they differ by more than {LOGPROB_TOLERANCE:g}.",
    )
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="Hugging Face model directory")
    parser.add_argument(
        "--prompt",
        action="append",
        default=None,
        metavar="TEXT",
        help="a prompt (repeat for several); default: a few built-in prompts",
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        metavar="N",
        help="number of prompts to sample, cycling through the given ones (default: one per prompt)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=24, metavar="N", help="tokens to generate per prompt (default: %(default)s)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        metavar="T",
        help="sampling temperature; 0 is greedy (default: %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="engine seed; prompt i is sampled with seed N + i (default: %(default)s)",
    )
    parser.add_argument(
        "--chat", action="store_true", help="send each prompt as a user message through the tokenizer's chat template"
    )
    parser.add_argument(
        "--check-logprobs", action="store_true", help="compare vLLM's logprobs with a transformers forward pass"
    )
    parser.add_argument("--dtype", default=None, help="engine dtype (default: float32 on CPU, the checkpoint's on GPU)")
    parser.add_argument(
        "--work-dir",
        default=None,
        metavar="DIR",
        help="directory for vLLM's temporary and IPC files (default: the system temp dir)",
    )
    parser.add_argument("--verbose", action="store_true", help="show vLLM's log (default: errors only)")
    return parser


def main(argv: list[str], *, llm: Any = None) -> int:
    """Run the command. `llm`: an already started `vllm.LLM` to use instead of starting one (tests, notebooks)."""
    args = parse_command_args(build_parser(), argv)
    if isinstance(args, int):
        return args
    error = _validate(args)
    if error:
        print(f"primerl generate: error: {error}", file=sys.stderr)
        return 2

    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        import warnings

        warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
    from primerl.inference.engine import EngineOptions, create_llm, shutdown_llm

    if llm is not None:
        return _generate_and_report(args, llm)
    print(f"starting vLLM engine on {args.model_dir} ...", flush=True)
    start = time.perf_counter()
    options = EngineOptions(
        model=args.model_dir,
        dtype=args.dtype,
        seed=args.seed,
        in_process=True,
        work_dir=args.work_dir,
        extra_args={} if args.verbose else {"use_tqdm_on_load": False},
    )
    try:
        llm = create_llm(options)
    except ValueError as error:
        print(f"primerl generate: error: {error}", file=sys.stderr)
        return 2
    print(f"engine ready in {time.perf_counter() - start:.1f} s", flush=True)
    try:
        return _generate_and_report(args, llm)
    finally:
        shutdown_llm(llm)


def _generate_and_report(args: argparse.Namespace, llm: Any) -> int:
    from primerl.inference.logprob_check import check_logprobs, engine_logprobs_mode, generate_with_logprobs

    texts = list(args.prompt or DEFAULT_PROMPTS)
    texts = list(itertools.islice(itertools.cycle(texts), args.num_prompts or len(texts)))
    prompts: list[Any] = texts
    if args.chat:
        tokenizer = llm.get_tokenizer()
        prompts = [
            list(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True, return_dict=False
                )
            )
            for text in texts
        ]
    result = generate_with_logprobs(
        llm, prompts, max_tokens=args.max_tokens, seed=args.seed, temperature=args.temperature
    )
    logprobs_mode = engine_logprobs_mode(llm)
    _print_samples(texts, result, chat=args.chat)
    print(
        f"\n{len(result.samples)} prompts, {result.num_completion_tokens} completion tokens in "
        f"{result.elapsed_s:.2f} s: {result.completion_tokens_per_s:,.0f} tokens/s "
        f"(temperature {args.temperature:g}, logprobs mode {logprobs_mode})"
    )
    if not args.check_logprobs:
        return 0
    start = time.perf_counter()
    diff = check_logprobs(args.model_dir, result.samples, logprobs_mode=logprobs_mode, temperature=args.temperature)
    verdict = "OK" if diff <= LOGPROB_TOLERANCE else "FAILED"
    print(
        f"logprob check against transformers (float32 forward pass, {time.perf_counter() - start:.1f} s): "
        f"max |vLLM - transformers| = {diff:.2e} over {result.num_completion_tokens} tokens, "
        f"tolerance {LOGPROB_TOLERANCE:g}: {verdict}"
    )
    return 0 if diff <= LOGPROB_TOLERANCE else 1


def _validate(args: argparse.Namespace) -> str | None:
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        return f"{model_dir} is not a model directory (no config.json); build one with `primerl init-tiny-model`"
    if args.num_prompts is not None and args.num_prompts < 1:
        return f"--num-prompts must be >= 1, got {args.num_prompts}"
    if args.max_tokens < 1:
        return f"--max-tokens must be >= 1, got {args.max_tokens}"
    if args.temperature < 0:
        return f"--temperature must be >= 0, got {args.temperature}"
    if args.seed < 0:
        return f"--seed must be >= 0, got {args.seed}"
    return None


def _print_samples(texts: list[str], result: Any, *, chat: bool) -> None:
    for index, (text, sample) in enumerate(zip(texts, result.samples, strict=True)):
        logprobs = sample.completion_logprobs
        print(f"\n[{index}] {'user' if chat else 'prompt'}: {text!r} ({len(sample.prompt_token_ids)} tokens)")
        print(f"    completion: {sample.text!r}")
        if logprobs:
            print(
                f"    {len(logprobs)} tokens, finish: {sample.finish_reason}; logprobs: "
                f"mean {statistics.fmean(logprobs):.3f}, min {min(logprobs):.3f}, max {max(logprobs):.3f}, "
                f"first {', '.join(f'{lp:.3f}' for lp in logprobs[:4])}"
            )


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
