"""`primerl init-tiny-model DIR`: build the tiny Qwen2 model and tokenizer primerl's demo and tests use
(`--moe`: a tiny Qwen3-MoE with the same tokenizer)."""

from __future__ import annotations

import argparse
import sys
import time

from primerl.cli.command_args import parse_command_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="primerl init-tiny-model",
        description="Build a tiny Qwen2-architecture causal LM with a byte-level BPE tokenizer and a ChatML chat "
        "template, offline and deterministically (same seed, same bytes). vLLM and transformers load it like "
        "any Hugging Face checkpoint.",
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
        "--moe",
        action="store_true",
        help="build a mixture-of-experts model (Qwen3-MoE: every layer a sparse MoE block) instead of a dense Qwen2",
    )
    parser.add_argument("--experts", type=int, default=8, help="with --moe: experts per layer (default: %(default)s)")
    parser.add_argument(
        "--experts-per-token",
        type=int,
        default=2,
        help="with --moe: experts each token is routed to, top-k (default: %(default)s)",
    )
    parser.add_argument(
        "--expert-size",
        type=int,
        default=64,
        help="with --moe: intermediate size of each expert, a multiple of 32 (default: %(default)s)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace DIR if it is not empty")
    return parser


def main(argv: list[str]) -> int:
    args = parse_command_args(build_parser(), argv)
    if isinstance(args, int):
        return args

    from primerl.trainer.tiny_model import TinyModelSpec, build_tiny_model, count_parameters, read_spec

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
            if args.moe
            else {}
        ),
    )
    if args.moe and args.experts < 1:
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
    if spec.is_moe:
        print(
            f"  Qwen3-MoE: {spec.num_experts} experts of size {spec.moe_intermediate_size} per layer, "
            f"top-{spec.num_experts_per_tok} routing"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
