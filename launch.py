"""kvflow command line: `generate` runs one prompt and streams the text to the terminal.

    python launch.py generate --model default "Write a haiku about the sea."
"""
from __future__ import annotations

import argparse
import logging
import sys


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help="a local HF folder (config.json, *.safetensors, tokenizer.json) or "
                             "'default' (SmolLM2-135M-Instruct, built on first use)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and KV cache dtype (auto: the checkpoint's)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="max prompt + output tokens per request (default: the model's)")
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="max requests running at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="token budget of one step (prefill chunks + decodes)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="turn automatic prefix caching off")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=None,
                        help="KV cache size in GiB (default: 10%% of available RAM, <= 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(tensor_parallel_size=args.tp, dtype=args.dtype,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                enable_prefix_caching=not args.no_prefix_caching,
                kv_cache_memory_gb=args.kv_cache_memory_gb, seed=args.seed)


def cmd_generate(args: argparse.Namespace) -> None:
    from kvflow import LLM, SamplingParams
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens)
    with LLM(args.model, **engine_kwargs(args)) as llm:
        prompt = args.prompt
        if not args.raw:
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        print(out.text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="launch.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="run one prompt and print the answer")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as is, without the chat template")
    add_engine_args(gen)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s: %(message)s")
    try:
        {"generate": cmd_generate}[args.command](args)
    except ValueError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
