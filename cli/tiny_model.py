"""`primerl init-tiny-model DIR`: build the tiny Qwen2 model and tokenizer primerl's demo and tests use
(`--moe`: a tiny Qwen3-MoE with the same tokenizer; `--family NAME`: another architecture, docs/models.md)."""

from __future__ import annotations

import argparse
import sys
import time

from primerl.cli.command_args import parse_command_args
from primerl.trainer.tiny_families import DEFAULT_FAMILY, DEFAULT_MOE_FAMILY, family_names, get_family


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="primerl init-tiny-model",
        description="Build a tiny Qwen2-architecture causal LM (or, with --family, one of another model family) "
        "with a byte-level BPE tokenizer and a chat template of the family's shape, offline and "
        "deterministically (same seed, same bytes). vLLM and transformers load it like any Hugging Face "
        "checkpoint.",
    )
    parser.add_argument(
        "dir",
        metavar="DIR",
        help="output directory: created; if it exists it must be empty or hold a tiny model built "
        "with the same options (then nothing is done)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="number of decoder layers (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default: %(default)s)")
    parser.add_argument("--intermediate", type=int, default=None, help="MLP intermediate size (default: 4 x hidden)")
    parser.add_argument(
        "--family",
        default=None,
        metavar="NAME",
        help=f"model family: {', '.join(family_names())} (default: {DEFAULT_FAMILY}; see docs/models.md)",
    )
    parser.add_argument(
        "--moe",
        action="store_true",
        help=f"build a mixture-of-experts model (--family {DEFAULT_MOE_FAMILY} unless --family names another MoE "
        "family) instead of a dense Qwen2",
    )
    parser.add_argument(
        "--experts", type=int, default=8, help="with an MoE family: experts per layer (default: %(default)s)"
    )
    parser.add_argument(
        "--experts-per-token",
        type=int,
        default=2,
        help="with an MoE family: experts each token is routed to, top-k (default: %(default)s)",
    )
    parser.add_argument(
        "--expert-size",
        type=int,
        default=64,
        help="with an MoE family: intermediate size of each expert, a multiple of 32 (default: %(default)s)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace DIR if it is not empty")
    return parser


def main(argv: list[str]) -> int:
    args = parse_command_args(build_parser(), argv)
    if isinstance(args, int):
        return args

    from primerl.trainer.tiny_model import TinyModelSpec, build_tiny_model, count_parameters, read_spec

    try:
        family = get_family(args.family or (DEFAULT_MOE_FAMILY if args.moe else DEFAULT_FAMILY))
    except ValueError as error:
        print(f"primerl init-tiny-model: error: --family: {error}", file=sys.stderr)
        return 2
    if args.moe and not family.moe:
        print(
            f"primerl init-tiny-model: error: --moe with --family {family.name}, a dense family; leave out --moe "
            f"or name an MoE family",
            file=sys.stderr,
        )
        return 2
    spec = TinyModelSpec(
        seed=args.seed,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        **(
            {
                "num_experts": args.experts,
                "num_experts_per_tok": args.experts_per_token,
                "moe_intermediate_size": args.expert_size,
            }
            if family.moe
            else {}
        ),
        family=family.name,
    )
    if family.moe and args.experts < 1:
        print(f"primerl init-tiny-model: error: --experts must be >= 1, got {args.experts}", file=sys.stderr)
        return 2
    if not args.overwrite and read_spec(args.dir) == spec:
        print(f"tiny model already in {args.dir} (same spec, same bytes): nothing to do")
        return 0
    start = time.perf_counter()
    try:
        path = build_tiny_model(args.dir, spec, overwrite=args.overwrite)
    except (ValueError, OSError) as error:
        print(f"primerl init-tiny-model: error: {error}", file=sys.stderr)
        return 2
    elapsed_s = time.perf_counter() - start
    num_params = count_parameters(path)
    print(f"tiny model written to {path}")
    print(
        f"  {num_params:,} parameters ({num_params / 1e6:.2f} M), hidden {spec.hidden_size}, "
        f"{spec.num_layers} layers, {spec.num_attention_heads} heads / {spec.num_key_value_heads} KV heads "
        f"(head_dim {spec.head_dim}), seed {spec.seed}; built in {elapsed_s:.1f} s"
    )
    print(f"  family {family.name} ({family.architecture}, the shape of {family.checkpoints}): {family.quirks}")
    if spec.is_moe:
        print(
            f"  {spec.num_experts} experts of size {spec.moe_intermediate_size} per layer, "
            f"top-{spec.num_experts_per_tok} routing"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
